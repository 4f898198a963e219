"""The run folder: what a stream leaves behind, written so that a killed run resumes cleanly.

Layout (``runs/<run_id>/``)::

    config.yaml             the resolved config
    state.json              committed stages (one StageResult each), written atomically
    memory/                 LanceDB (the ``cards`` table)
    trajectories/stage-t.jsonl   the stage's expert trajectories
    episodes/stage-t-<domain>.jsonl  evaluation episodes
    adapters/stage-t/       peft adapters (loadable by vLLM and peft)
    tensorboard/            per-stage and per-step scalars (hamo_ray.tracking)
    results/scores.csv      one row per stage x domain (score, episodes, failed episodes: not in the score)
    results/metrics.json    averages, final scores, forgetting

A stage counts only once ``state.json`` lists it; a half-written stage is redone on resume.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from hamo_ray.config import ConfigError, HamoConfig, upgrade_saved_config
from hamo_ray.evaluation.metrics import summarize
from hamo_ray.types import StageResult, Trajectory

logger = logging.getLogger(__name__)

# Keys that may differ between the run that started a folder and the one resuming it.
_RESUMABLE_KEYS = {"run", "ray", "serve", "rollout"}
# Keys outside those sections that change how a stage is computed, not what it computes.
_RESUMABLE_FIELDS = {
    "train.engine", "train.max_failures", "train.storage", "train.keep_workers", "env.expert_cache"
}  # fmt: skip
# Keys inside those sections that do change what is computed: a resume must keep them.
_IDENTITY_FIELDS = {"rollout.constrain_actions"}


def compared(section: str, key: str) -> bool:
    """Whether a resumed run (or a sweep's exported cell) must hold the same ``section.key``."""
    dotted = f"{section}.{key}"
    if dotted in _IDENTITY_FIELDS:
        return True
    return section not in _RESUMABLE_KEYS and dotted not in _RESUMABLE_FIELDS


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class PhaseClock:
    """Wall seconds per named phase, for ``StageResult.seconds`` and ``state.json``'s timings::

        clock = PhaseClock()
        with clock("train"):
            ...
        clock.seconds  # {"train": 12.3}

    Args:
        into: the dict to record into (e.g. ``RunFolder.timings``); a new one when None.
    """

    def __init__(self, into: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = {} if into is None else into

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:  # a phase entered twice adds up
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


def _write_jsonl(path: Path, items: list[Trajectory]) -> None:
    atomic_write(path, "".join(t.model_dump_json() + "\n" for t in items))


class RunFolder:
    def __init__(self, path: Path, cfg: HamoConfig) -> None:
        self.path = Path(path).resolve()
        self.cfg = cfg
        self.timings: dict[str, float] = {}
        self.backbone: str | None = None  # the resolved backbone path (jobs/serve.py reads it)

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def adapters_dir(self) -> Path:
        return self.path / "adapters"

    @property
    def memory_uri(self) -> str:
        return self.cfg.memory.uri or str(self.path / "memory")

    def stages(self) -> list[StageResult]:
        if not self.state_file.exists():
            return []
        data = json.loads(self.state_file.read_text())
        return [StageResult.model_validate(s) for s in data["stages"]]

    def prepare(self) -> list[StageResult]:
        """Create the folder, or check an existing one and return its committed stages.

        Raises:
            ConfigError: the folder holds finished stages and neither resume nor overwrite is set,
                or it was started with a config that differs in keys that change results.
        """
        done = self.stages()
        if self.path.exists() and self.cfg.run.overwrite:
            logger.warning("run.overwrite=true: deleting %s", self.path)
            shutil.rmtree(self.path)
            done = []
        elif done and not self.cfg.run.resume:
            raise ConfigError(
                f"run folder {self.path} already holds {len(done)} finished stage(s); "
                "pass run.resume=true to continue it, run.overwrite=true to start over, or another run.id"
            )
        elif done:
            self._check_same_config()
            logger.info("resuming %s after stage %d", self.path, len(done))
        self.path.mkdir(parents=True, exist_ok=True)
        self.adapters_dir.mkdir(exist_ok=True)
        if not done:
            atomic_write(self.path / "config.yaml", self.cfg.to_yaml())
        return done

    def _check_same_config(self) -> None:
        saved_file = self.path / "config.yaml"
        if not saved_file.exists():
            return
        saved = upgrade_saved_config(yaml.safe_load(saved_file.read_text()))  # an older layout too
        now = self.cfg.model_dump(mode="json")
        # A key the saved config lacks was added to the code after the run started: it holds its default
        # (the run did what the default does), so a resume after an upgrade is not refused for it.
        defaults = HamoConfig().model_dump(mode="json")
        diffs = [
            f"{section}.{key}"
            for section, values in now.items()
            if isinstance(values, dict)
            for key, value in values.items()
            if compared(section, key)
            and saved.get(section, {}).get(key, defaults.get(section, {}).get(key)) != value
        ]
        if diffs:
            raise ConfigError(
                f"run folder {self.path} was started with a different config ({', '.join(diffs)}); "
                "use another run.id or run.overwrite=true"
            )

    def store(self, cfg: HamoConfig):
        from hamo_ray.memory.store import MemoryStore

        return MemoryStore.from_config(self.memory_uri, cfg.memory)

    def save_trajectories(self, stage: int, trajs: list[Trajectory]) -> None:
        _write_jsonl(self.path / "trajectories" / f"stage-{stage}.jsonl", trajs)

    def load_trajectories(self, stage: int) -> list[Trajectory] | None:
        f = self.path / "trajectories" / f"stage-{stage}.jsonl"
        if not f.exists():
            return None
        return [Trajectory.model_validate_json(line) for line in f.read_text().splitlines() if line.strip()]

    def anchors(self, results: list[StageResult]) -> list[Trajectory]:
        """The anchor trajectories of committed stages (what replay samples from)."""
        out = []
        for r in results:
            chosen = set(r.anchors)
            out += [t for t in self.load_trajectories(r.stage) or [] if r.stage > 0 and t.id in chosen]
        return out

    def save_episodes(self, stage: int, domain: str, trajs: list[Trajectory]) -> None:
        _write_jsonl(self.path / "episodes" / f"stage-{stage}-{domain}.jsonl", trajs)

    def commit(self, result: StageResult) -> None:
        """Record a finished stage: state.json first (atomically), then the results it implies."""
        stages = [s for s in self.stages() if s.stage != result.stage] + [result]
        stages.sort(key=lambda s: s.stage)
        state = {
            "stages": [s.model_dump(mode="json") for s in stages],
            "backbone": self.backbone,
            "timings": self.timings,
        }
        atomic_write(self.state_file, json.dumps(state, indent=1))
        self.write_results(stages)

    def write_results(self, stages: list[StageResult]) -> None:
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(["stage", "domain", "method", "score", "episodes", "failed"])
        for s in stages:
            for domain, score in sorted(s.scores.items()):
                counts = [s.evaluation.get(f"{k}/{domain}") for k in ("episodes", "failed")]
                writer.writerow(
                    [
                        s.stage,
                        domain,
                        s.method,
                        f"{score:.4f}",
                        *("" if c is None else int(c) for c in counts),
                    ]
                )
        atomic_write(self.path / "results" / "scores.csv", buf.getvalue())
        initial = next((s.scores for s in stages if s.stage == 0), None)
        trained = [s for s in stages if s.stage > 0]
        metrics = summarize([s.scores for s in trained], [s.domain for s in trained], initial)
        metrics["method"] = self.cfg.method.name
        metrics["budgets"] = [s.budget for s in stages]
        metrics["evaluation"] = {str(s.stage): s.evaluation for s in stages if s.evaluation}
        atomic_write(self.path / "results" / "metrics.json", json.dumps(metrics, indent=1))
        if trained:  # plots and report.md, as a sweep has (a failure there never loses a committed stage)
            from hamo_ray.evaluation.plots import write_run_report

            try:
                write_run_report(self.path)
            except Exception:  # noqa: BLE001 - the report is a view of results already written
                logger.warning("run report of %s failed", self.path, exc_info=True)
