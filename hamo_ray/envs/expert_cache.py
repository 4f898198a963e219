"""A shared cache of the simulators' expert trajectories, so runs on the same tasks train on the same data.

A simulator's expert is not replayed identically: ScienceWorld regenerates its gold paths on every
load (another room visited first, another animal focused on; same scores). Two runs of one seed, e.g.
two methods of a sweep, would otherwise distil and train on different expert trajectories, and the
difference between them would mix the methods with this noise. With ``env.expert_cache`` set to a
folder, the first run that plays a stage's tasks stores its usable expert trajectories there, and every
later run with the same tasks and expert settings reads them instead of playing the expert again::

    env:
      expert_cache: runs/experts        # a sweep sets <root>/experts itself (sweep.share_experts)

An entry is ``<cache>/<domain>-<key>.jsonl``; ``key`` hashes what decides the expert's play: the
domain, the stage's tasks (task, variation, split, in order), ``env.max_turns`` and the domain's own
settings (``env.<domain>``). A run that plays the expert holds ``<entry>.lock`` meanwhile, so a second
run on the same tasks (a parallel sweep cell) waits and then reads what the first stored. An entry that
cannot be read is named in a warning and replaced. Several machines share the cache only through a
shared folder; imported experts (``env.expert_source: file``) are the same in every run and skip it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from hamo_ray.config import HamoConfig
from hamo_ray.types import TaskSpec, Trajectory

logger = logging.getLogger(__name__)

KEY_VERSION = 1  # bump when what an entry holds changes meaning


def cache_key(cfg: HamoConfig, domain: str, tasks: list[TaskSpec]) -> str:
    """The hash of what decides a stage's expert trajectories (tasks in order, turn cap, domain settings)."""
    section = getattr(cfg.env, domain, None)
    what = {
        "version": KEY_VERSION,
        "domain": domain,
        "tasks": [[t.task, t.variation, t.split] for t in tasks],
        "max_turns": cfg.env.max_turns,
        "settings": section.model_dump(mode="json") if section is not None else None,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def entry_path(cfg: HamoConfig, domain: str, tasks: list[TaskSpec]) -> Path | None:
    """The cache file of these tasks, or None when ``env.expert_cache`` is unset."""
    if not cfg.env.expert_cache:
        return None
    return Path(cfg.env.expert_cache).expanduser() / f"{domain}-{cache_key(cfg, domain, tasks)}.jsonl"


def read_entry(path: Path) -> list[Trajectory] | None:
    """The trajectories stored at ``path``; None (with a warning naming the file) when unreadable or empty."""
    try:
        lines = path.read_text().splitlines()
        trajs = [Trajectory.model_validate_json(line) for line in lines if line.strip()]
    except (OSError, ValueError, ValidationError) as exc:
        logger.warning("expert cache: %s cannot be read (%s); playing the expert again", path, exc)
        return None
    if not trajs:
        logger.warning("expert cache: %s holds no trajectory; playing the expert again", path)
        return None
    return trajs


def write_entry(path: Path, trajs: list[Trajectory]) -> None:
    """Store ``trajs`` at ``path`` atomically (a reader sees the whole entry or none)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(t.model_dump_json() + "\n" for t in trajs))
    tmp.replace(path)


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def cached_experts(
    cfg: HamoConfig, domain: str, tasks: list[TaskSpec], play: Callable[[], list[Trajectory]]
) -> tuple[list[Trajectory], bool]:
    """``(trajectories, from_cache)``: the stored entry of these tasks, else ``play()``'s, then stored.

    Without ``env.expert_cache`` this is ``(play(), False)``. ``play`` returns the usable expert
    trajectories (or raises; nothing is stored then).
    """
    path = entry_path(cfg, domain, tasks)
    if path is None:
        return play(), False
    with _locked(path):
        if path.is_file() and (stored := read_entry(path)) is not None:
            logger.info(
                "collect: %d expert trajectories of %d tasks from the cache %s", len(stored), len(tasks), path
            )
            return stored, True
        trajs = play()
        write_entry(path, trajs)
        logger.info("collect: stored %d expert trajectories in the cache %s", len(trajs), path)
        return trajs, False


def play_experts(pool, tasks: list[TaskSpec], max_turns: int, stage: int, domain: str) -> list[Trajectory]:
    """The domain's expert plans played by ``pool`` on ``tasks``: the usable ones (else RuntimeError).

    Failed and unscored episodes are left out; plans cut at ``max_turns`` that still scored are kept.
    """
    got = pool.run(tasks, None, desc=f"stage {stage} expert episodes ({domain})")
    ok = [t for t in got if t.error is None and t.actions and t.score > 0]
    cut = sum(not t.done and len(t.actions) >= max_turns for t in got if t.error is None)
    if cut:
        logger.warning(
            "collect: %d of %d expert plans were cut at env.max_turns=%d (evaluation stops there); "
            "%d of them still scored and are kept",
            cut, len(got), max_turns, sum(not t.done for t in ok),
        )  # fmt: skip
    if len(ok) < len(got):
        logger.warning(
            "collect: %d of %d expert episodes failed or scored 0 and are left out",
            len(got) - len(ok),
            len(got),
        )
    if not ok:
        raise RuntimeError(f"stage {stage}: no usable expert trajectory")
    return ok
