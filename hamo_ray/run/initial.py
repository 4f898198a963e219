"""Stage 0 evaluated once and shared by the runs it is the same for (``eval.initial_cache``).

Stage 0 (``protocol.eval_initial``) plays every domain's test set on the base model before any stage:
no adapter exists yet and the memory is empty, so what a method switches on or off (training,
selection, replay, conditioning, and retrieval, which finds no card) does not change a single prompt.
The methods of one seed in a sweep therefore play the same episodes at stage 0 (measured on the
powered SmolLM2 rerun: ``model_only``, ``agenttuning`` and ``hamo`` took the same actions in all 24
episodes of seed 0), about 4.5 minutes a cell on 2 cores. With ``eval.initial_cache`` set to a folder
(a sweep sets ``<root>/initial``, ``sweep.share_initial``), the first run evaluates stage 0 and stores
its result and episodes there; every later run with the same key copies them into its own folder and
commits them as its stage 0, naming the run it came from (``StageResult.initial_from``)::

    eval:
      initial_cache: runs/initial

The key (``initial_key``) hashes the whole config except what cannot act at stage 0 (``method``,
``train``, ``selection``, ``replay``, ``memory``, the run's id, root and tracking, this cache's path and
the secrets), plus the test tasks in order. A run whose memory is not empty at stage 0 (a shared
``memory.uri`` holding cards, with retrieval on) is not shared. The entry holds what was hashed
(``key.json``), so a reader can see what the runs had in common. A run that evaluates holds
``<entry>.lock`` meanwhile, so a parallel run with the same key waits and then reads the entry; an
entry that cannot be read is named in a warning, evaluated again and replaced.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from hamo_ray.config import SECRET_KEYS, HamoConfig
from hamo_ray.run.folder import RunFolder
from hamo_ray.types import StageResult, TaskSpec, Trajectory

logger = logging.getLogger(__name__)

KEY_VERSION = 1  # bump when what an entry holds, or what stage 0 depends on, changes meaning
# Sections that cannot act at stage 0: no adapter, an empty memory (checked), no training data.
_NOT_AT_STAGE_0 = ("method", "train", "selection", "replay", "memory")
_NOT_AT_STAGE_0_FIELDS = (
    "run.id",
    "run.root",
    "run.resume",
    "run.overwrite",
    "run.tracking",
    "eval.initial_cache",
)

Evaluation = tuple[dict[str, float], dict[str, float]]  # scores by domain, the evaluation's figures


def key_material(cfg: HamoConfig, tests: Mapping[str, list[TaskSpec]]) -> dict:
    """What decides stage 0's episodes: the config without what cannot act there, and the test tasks."""
    config = cfg.model_dump(mode="json")
    for section in _NOT_AT_STAGE_0:
        config.pop(section, None)
    for dotted in (*_NOT_AT_STAGE_0_FIELDS, *SECRET_KEYS):
        section, _, rest = dotted.partition(".")
        node = config.get(section)
        *parents, leaf = rest.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return {
        "version": KEY_VERSION,
        "config": config,
        "tests": {d: [[t.task, t.variation, t.split] for t in tasks] for d, tasks in tests.items()},
    }


def initial_key(cfg: HamoConfig, tests: Mapping[str, list[TaskSpec]]) -> str:
    """The hash of ``key_material``: runs with the same key play the same stage 0."""
    what = json.dumps(key_material(cfg, tests), sort_keys=True)
    return hashlib.sha256(what.encode()).hexdigest()[:20]


def unshared_reason(cfg: HamoConfig, cards_at_stage_0: Callable[[], int]) -> str | None:
    """Why this run's stage 0 must not be shared (None: it may): no cache set, or retrieval over a
    memory that already holds cards (``cards_at_stage_0`` counts them; called only with retrieval on)."""
    if not cfg.eval.initial_cache:
        return "eval.initial_cache is not set"
    if cfg.method.retrieval and (n := cards_at_stage_0()):
        return f"the memory holds {n} cards before stage 0 (retrieval would inject them)"
    return None


@contextmanager
def _locked(entry: Path) -> Iterator[None]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        yield


def _read(entry: Path, domains: list[str]) -> tuple[dict, dict[str, list[Trajectory]]] | None:
    """The stored result and each domain's episodes; None (with a warning) when unreadable or incomplete."""
    try:
        stored = json.loads((entry / "result.json").read_text())
        episodes = {}
        for domain in domains:
            lines = (entry / "episodes" / f"stage-0-{domain}.jsonl").read_text().splitlines()
            episodes[domain] = [Trajectory.model_validate_json(line) for line in lines if line.strip()]
        missing = [d for d in domains if d not in stored["scores"]]
        if missing or not all(episodes.values()):
            raise ValueError(f"no score or no episode for {', '.join(missing) or 'a domain'}")
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as exc:
        logger.warning("stage 0: the shared entry %s cannot be read (%s); evaluating again", entry, exc)
        return None
    return stored, episodes


def _write(entry: Path, folder: RunFolder, what: dict, scores: dict, stats: dict, seconds: dict) -> None:
    """Store this run's stage 0 at ``entry`` atomically: a temporary folder renamed into place."""
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "episodes").mkdir(parents=True)
    for domain in scores:
        src = folder.path / "episodes" / f"stage-0-{domain}.jsonl"
        shutil.copyfile(src, tmp / "episodes" / src.name)
    record = {"scores": scores, "evaluation": stats, "seconds": seconds, "source": folder.path.name}
    (tmp / "result.json").write_text(json.dumps(record, indent=1))
    (tmp / "key.json").write_text(json.dumps(what, indent=1, sort_keys=True))
    if entry.exists():  # an unreadable entry, replaced
        shutil.rmtree(entry)
    tmp.rename(entry)


def shared_initial(
    cfg: HamoConfig,
    folder: RunFolder,
    tests: Mapping[str, list[TaskSpec]],
    evaluate: Callable[[], tuple[Evaluation, dict[str, float]]],
    cards_at_stage_0: Callable[[], int] = lambda: 0,
) -> StageResult:
    """This run's stage 0: copied from the shared entry of its key, else ``evaluate()``'d and stored.

    Args:
        evaluate: plays stage 0 into ``folder`` (episodes saved there); returns ``((scores, figures),
            seconds by phase)``.
        cards_at_stage_0: the number of cards retrieval could find now (asked only with retrieval on).

    Returns:
        The stage 0 result to commit; ``initial_from`` names the run whose evaluation it is when copied.
    """
    name = cfg.method.name
    reason = unshared_reason(cfg, cards_at_stage_0)
    if reason is not None:
        if cfg.eval.initial_cache:
            logger.info("stage 0: not shared (%s)", reason)
        (scores, stats), seconds = evaluate()
        return StageResult.initial(name, scores, seconds, stats)
    what = key_material(cfg, tests)
    entry = Path(cfg.eval.initial_cache).expanduser() / f"stage0-{initial_key(cfg, tests)}"
    with _locked(entry):
        start = time.perf_counter()
        stored = _read(entry, list(tests)) if entry.is_dir() else None
        if stored is not None:
            record, episodes = stored
            for domain, trajs in episodes.items():
                folder.save_episodes(0, domain, trajs)
            logger.info(
                "stage 0: the evaluation of run %s, shared from %s (scores %s)",
                record["source"],
                entry,
                record["scores"],
            )
            result = StageResult.initial(
                name, record["scores"], {"evaluate": time.perf_counter() - start}, record["evaluation"]
            )
            return result.model_copy(update={"initial_from": record["source"]})
        (scores, stats), seconds = evaluate()
        _write(entry, folder, what, scores, stats, seconds)
        logger.info("stage 0: stored in %s for the runs with the same key", entry)
        return StageResult.initial(name, scores, seconds, stats)
