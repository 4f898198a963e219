"""The run folder: what a stream leaves behind, written so that a killed run resumes cleanly.

Layout (``runs/<run_id>/``)::

    config.yaml             the resolved config (secret values left out)
    state.json              committed stages (one StageResult each), written atomically, last
    .lock                   held by the job running the folder (who: host, pid, since)
    memory/                 LanceDB (the ``cards`` table)
    trajectories/stage-t.jsonl   the stage's expert trajectories
    episodes/stage-t-<domain>.jsonl  evaluation episodes
    adapters/stage-t/       peft adapters (loadable by vLLM and peft)
    tensorboard/            per-stage and per-step scalars (hamo_ray.run.tracking)
    results/scores.csv      one row per stage x domain (score, episodes, failed episodes: not in the score)
    results/metrics.json    averages, final scores, forgetting

A stage counts only once ``state.json`` lists it; a half-written stage is redone on resume. A
commit writes the stage's results first and ``state.json`` last, each file fsync'd and renamed into
place, so a kill or a full disk at any moment leaves either the previous commit or the new one: results
that run ahead of the state are rewritten by the next commit, and a stage is never listed as
done without its rows. One job at a time holds the folder (``RunFolder.lock``).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from hamo_ray.config import SECRET_KEYS, ConfigError, HamoConfig, upgrade_saved_config
from hamo_ray.evaluation.faults import fault_point
from hamo_ray.evaluation.metrics import summarize
from hamo_ray.types import StageResult, Trajectory

logger = logging.getLogger(__name__)

# Keys that may differ between the run that started a folder and the one resuming it.
_RESUMABLE_KEYS = {"run", "ray", "serve", "rollout", "eval"}  # eval: how faults are judged
# Keys outside those sections that change how a stage is computed, not what it computes.
_RESUMABLE_FIELDS = {
    "train.engine", "train.max_failures", "train.storage", "train.keep_workers", "env.expert_cache"
}  # fmt: skip
# Keys inside those sections that do change what is computed: a resume must keep them.
_IDENTITY_FIELDS = {"rollout.constrain_actions"}


def compared(section: str, key: str) -> bool:
    """Whether a resumed run (or a sweep's exported cell) must hold the same ``section.key``."""
    dotted = f"{section}.{key}"
    if dotted in SECRET_KEYS:  # saved masked (never written), given again by the environment on resume
        return False
    if dotted in _IDENTITY_FIELDS:
        return True
    return section not in _RESUMABLE_KEYS and dotted not in _RESUMABLE_FIELDS


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` durably: a unique temporary file beside it, fsync'd, renamed over
    it, and the folder fsync'd; a failure (a full disk) leaves the old file whole and no temporary.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")  # the umask's mode
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class RunLockedError(ConfigError):
    """Another job holds the run folder."""


class PhaseClock:
    """Wall seconds per named phase, for ``StageResult.seconds`` and ``state.json``'s timings::

        clock = PhaseClock()
        with clock("train"):
            ...
        clock.seconds  # {"train": 12.3}

    Args:
        into: the dict to record into (e.g. ``RunFolder.timings``); a new one when None.
        tag: names the phases' fault points (``<tag>:<phase>``, ``evaluation.faults.fault_point``).
    """

    def __init__(self, into: dict[str, float] | None = None, tag: str = "") -> None:
        self.seconds: dict[str, float] = {} if into is None else into
        self.tag = tag

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:  # a phase entered twice adds up
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
        if self.tag:
            fault_point(f"{self.tag}:{phase}")


def committed_stage_count(run_dir: Path) -> int | None:
    """How many trained stages ``run_dir/state.json`` lists (None: no state file). Results are written
    before the state, so results that list more stages than this hold an uncommitted one."""
    state = Path(run_dir) / "state.json"
    if not state.is_file():
        return None
    return sum(1 for s in json.loads(state.read_text()).get("stages", []) if s.get("stage", 0) > 0)


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

    def lock(self) -> None:
        """Hold the folder for this job until :meth:`unlock` or the process ends (a kill releases it).

        An advisory ``flock`` on ``<folder>/.lock``, which names the holder (host, pid, start time).

        Raises:
            RunLockedError: another job holds the folder; the message names it.
        """
        import fcntl

        self.path.mkdir(parents=True, exist_ok=True)
        f = open(self.path / ".lock", "a+")  # noqa: SIM115 - held open while the job runs
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "a job that has not written its name yet"
            f.close()
            raise RunLockedError(
                f"run folder {self.path} is in use by another job ({holder}); wait for it or stop it, "
                "or choose another run.id"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(
            f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        f.flush()
        self._lock_file = f

    def unlock(self) -> None:
        f = getattr(self, "_lock_file", None)
        if f is not None:
            f.close()  # closing the descriptor releases the flock
            self._lock_file = None

    def prepare(self) -> list[StageResult]:
        """Create the folder, or check an existing one and return its committed stages.

        Raises:
            ConfigError: the folder holds finished stages and neither resume nor overwrite is set,
                it was started with a config that differs in keys that change results, or
                ``run.overwrite`` names a folder that is no run folder.
        """
        done = self.stages()
        if self.path.exists() and self.cfg.run.overwrite:
            self._clear()
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

    def _clear(self) -> None:
        """``run.overwrite``: empty the folder (its ``.lock`` stays: this job holds it), only a run folder."""
        entries = [e for e in self.path.iterdir() if e.name != ".lock"]
        marks = {"state.json", "config.yaml"}
        if entries and not any(e.name in marks for e in entries):
            raise ConfigError(
                f"run.overwrite: {self.path} holds no config.yaml or state.json, so it is no run folder; "
                "not deleting it (check run.root and run.id)"
            )
        logger.warning("run.overwrite=true: deleting the contents of %s", self.path)
        for e in entries:
            if e.is_dir() and not e.is_symlink():
                shutil.rmtree(e)
            else:
                e.unlink()

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

        # The table is the run id's in a shared memory.uri (hamo_ray.naming.memory_table); the folder is named by it.
        return MemoryStore.from_config(self.memory_uri, cfg.memory, run_id=self.path.name)

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
        """Record a finished stage: its results first, ``state.json`` last (each written atomically).

        The stage counts once ``state.json`` lists it, so a kill between the two leaves the stage
        uncommitted (redone on resume, its results rewritten then), never committed without rows.
        """
        stages = [s for s in self.stages() if s.stage != result.stage] + [result]
        stages.sort(key=lambda s: s.stage)
        state = {
            "stages": [s.model_dump(mode="json") for s in stages],
            "backbone": self.backbone,
            "timings": self.timings,
        }
        self.write_results(stages, report=False)
        fault_point(f"stage-{result.stage}:commit")
        atomic_write(self.state_file, json.dumps(state, indent=1))
        self.write_report(stages)

    def write_results(self, stages: list[StageResult], report: bool = True) -> None:
        """``results/scores.csv`` and ``results/metrics.json`` of ``stages`` (and, with ``report``, the
        plots and ``report.md``)."""
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
        if report:
            self.write_report(stages)

    def write_report(self, stages: list[StageResult]) -> None:
        """Plots and ``report.md`` from ``results/metrics.json``, as a sweep has (never fails a commit)."""
        if any(s.stage > 0 for s in stages):
            from hamo_ray.evaluation.plots import write_run_report

            try:
                write_run_report(self.path)
            except Exception:  # noqa: BLE001 - the report is a view of results already written
                logger.warning("run report of %s failed", self.path, exc_info=True)
