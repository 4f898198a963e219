"""ScienceWorld's task list and each task's train/dev/test variations (no simulator needed for the
tabulated package version). The domain (``hamo_ray.envs.scienceworld``) and the expert-id maps
(``hamo_ray.envs.expert_ids``) both read them here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hamo_ray.config import ConfigError
from hamo_ray.envs.scienceworld_jvm import capped_env_class

logger = logging.getLogger(__name__)

DEFAULT_JVM_HEAP = "512m"  # env.scienceworld.jvm_heap's default


# (train_end, dev_end, num_variations) per task, read from the scienceworld 1.2.3 jar:
# train = range(0, train_end), dev = range(train_end, dev_end), test = range(dev_end, num_variations).
_SPLITS_VERSION = "1.2.3"
_SPLITS_1_2_3: dict[str, tuple[int, int, int]] = {
    "boil": (14, 21, 30),
    "change-the-state-of-matter-of": (14, 21, 30),
    "chemistry-mix": (16, 24, 32),
    "chemistry-mix-paint-secondary-color": (18, 27, 36),
    "chemistry-mix-paint-tertiary-color": (18, 27, 36),
    "find-animal": (150, 225, 300),
    "find-living-thing": (150, 225, 300),
    "find-non-living-thing": (150, 225, 300),
    "find-plant": (150, 225, 300),
    "freeze": (14, 21, 30),
    "grow-fruit": (62, 93, 126),
    "grow-plant": (62, 93, 126),
    "identify-life-stages-1": (6, 9, 14),
    "identify-life-stages-2": (4, 6, 10),
    "inclined-plane-determine-angle": (84, 126, 168),
    "inclined-plane-friction-named-surfaces": (692, 1038, 1386),
    "inclined-plane-friction-unnamed-surfaces": (80, 120, 162),
    "lifespan-longest-lived": (62, 93, 125),
    "lifespan-longest-lived-then-shortest-lived": (62, 93, 125),
    "lifespan-shortest-lived": (62, 93, 125),
    "measure-melting-point-known-substance": (218, 327, 436),
    "measure-melting-point-unknown-substance": (150, 225, 300),
    "melt": (14, 21, 30),
    "mendelian-genetics-known-plant": (60, 90, 120),
    "mendelian-genetics-unknown-plant": (240, 360, 480),
    "power-component": (10, 15, 20),
    "power-component-renewable-vs-nonrenewable-energy": (10, 15, 20),
    "test-conductivity": (450, 675, 900),
    "test-conductivity-of-unknown-substances": (300, 450, 600),
    "use-thermometer": (270, 405, 540),
}

# Variations per task and split for package versions other than the tabulated one, filled once per
# process from a JVM (see variation_splits).
_QUERIED_SPLITS: dict[str, dict[str, tuple[int, ...]]] = {}


def task_names() -> list[str]:
    """The package's 30 task names, in task-id order, read from its ``tasks.json`` (no JVM)."""
    from scienceworld.constants import ID2TASK
    from scienceworld.utils import infer_task

    return [infer_task(name) for name in ID2TASK.values()]


def query_splits(sw: Any) -> dict[str, dict[str, tuple[int, ...]]]:
    """Ask a running simulator for every task's train/dev/test variations (~0.1 s a task).

    Args:
        sw: a ``scienceworld.ScienceWorldEnv`` (or subclass); its loaded task is replaced.
    """
    splits = {}
    for name in sw.get_task_names():
        sw.load(name, 0, "")
        splits[name] = {
            "train": tuple(sw.get_variations_train()),
            "dev": tuple(sw.get_variations_dev()),
            "test": tuple(sw.get_variations_test()),
        }
    return splits


def variation_splits(task_type: str) -> dict[str, Sequence[int]]:
    """The variation indices of ``task_type`` in each split, in the package's order.

    Raises:
        ConfigError: ``task_type`` is not a ScienceWorld task.
    """
    from scienceworld import __version__

    if __version__ == _SPLITS_VERSION:
        if task_type not in _SPLITS_1_2_3:
            raise _unknown_task(task_type)
        train_end, dev_end, total = _SPLITS_1_2_3[task_type]
        return {"train": range(train_end), "dev": range(train_end, dev_end), "test": range(dev_end, total)}
    if not _QUERIED_SPLITS:
        logger.info("scienceworld %s: reading variation splits from a JVM (one-off)", __version__)
        sw = capped_env_class()(DEFAULT_JVM_HEAP)
        try:
            _QUERIED_SPLITS.update(query_splits(sw))
        finally:
            sw.close()
    if task_type not in _QUERIED_SPLITS:
        raise _unknown_task(task_type)
    return _QUERIED_SPLITS[task_type]


def _unknown_task(task_type: str) -> ConfigError:
    return ConfigError(f"unknown scienceworld task type {task_type!r}; known: {', '.join(task_names())}")
