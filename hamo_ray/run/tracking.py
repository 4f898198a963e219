"""Experiment tracking: TensorBoard event files in every run folder, Weights & Biases or MLflow as a setting.

The stream's ``Tracker`` records per-stage scores, budgets, phase timings and memory size (step = the
stage), and every training step (loss, learning rate, tokens/s, which rank 0 of the training workers
returns with the stage's result: ``train/*``, ``dpo/*`` for ETO's DPO), numbered on across stages so
stage k's steps follow stage k-1's. Everything goes under ``<run folder>/tensorboard/``, so one command
shows every run of a root::

    tensorboard --logdir runs/

``run.tracking`` lists the backends: ``tensorboard`` (always available: ``tensorboardX`` writes the event
files), ``wandb`` and ``mlflow`` (their packages are optional; both work offline: W&B writes an offline
run under the run folder unless ``WANDB_MODE`` says otherwise, MLflow a file store ``<run>/mlruns`` unless
``MLFLOW_TRACKING_URI`` is set)::

    tracker = Tracker(run_dir, ["tensorboard"], name="stage")
    tracker.log({"score/alfworld": 41.0}, step=1)
    tracker.log_steps([{"loss": 1.9, "lr": 2e-4, "tokens_per_s": 5100.0}, ...])   # train/loss, ...
    tracker.close()
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BACKENDS = ("tensorboard", "wandb", "mlflow")


def check_backends(backends: list[str] | tuple[str, ...]) -> None:
    """Fail before any work when a tracking backend is unknown or its package is missing.

    Raises:
        ValueError: naming the backend and the package to install.
    """
    import importlib.util

    packages = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
    for name in backends:
        if name not in packages:
            raise ValueError(f"run.tracking: unknown backend {name!r} (known: {', '.join(BACKENDS)})")
        if importlib.util.find_spec(packages[name]) is None:
            raise ValueError(
                f"run.tracking includes {name!r} but the {packages[name]} package is not installed "
                f"(pip install {packages[name]})"
            )


class Tracker:
    """Scalars to every configured backend; a missing backend fails at construction, naming it.

    Args:
        run_dir: the run folder; event files go to ``<run_dir>/tensorboard/<name>``.
        backends: from ``run.tracking``.
        name: the writer's sub-folder (``stream``, ``train``), one per process.
        config: the resolved run config (``model_dump(mode="json")``), recorded once by W&B and MLflow
            with its secrets masked (``***``).
    """

    def __init__(
        self,
        run_dir: str | Path,
        backends: list[str] | tuple[str, ...],
        name: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        check_backends(backends)
        if config:  # what W&B and MLflow record: never a secret (hamo_ray/config/secrets.py)
            from hamo_ray.config.secrets import mask_secrets

            config = mask_secrets(config)
        self.run_dir = Path(run_dir)
        self.backends = tuple(backends)
        self._tb = self._wandb = self._mlflow = None
        self._next_step: dict[str, int] = {}  # section -> the next global training step
        if "tensorboard" in backends:
            from tensorboardX import SummaryWriter

            folder = self.run_dir / "tensorboard" / name
            if folder.is_dir():  # a resumed run: its training steps number on from the recorded ones
                for tag, points in read_scalars(folder).items():
                    section, _, key = tag.partition("/")
                    if key == "loss" and points:
                        self._next_step[section] = max(s for s, _ in points) + 1
            # Event file names hold the second they were made: a suffix keeps a quick resume's file apart.
            suffix = f".{os.getpid()}.{uuid.uuid4().hex[:8]}"
            self._tb = SummaryWriter(str(folder), flush_secs=10, filename_suffix=suffix)
        if "wandb" in backends:
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(
                dir=str(self.run_dir),
                project="hamo-ray",
                name=f"{self.run_dir.name}-{name}",
                config=config or {},
                reinit=True,
            )
            # W&B wants one increasing step per run: each section gets its own x axis instead.
            self._wandb.define_metric("stage")
            for prefix in ("score", "seconds", "stage", "memory"):
                self._wandb.define_metric(f"{prefix}/*", step_metric="stage")
            for section in ("train", "dpo"):
                self._wandb.define_metric(f"{section}/step")
                self._wandb.define_metric(f"{section}/*", step_metric=f"{section}/step")
        if "mlflow" in backends:
            import mlflow

            if not os.environ.get("MLFLOW_TRACKING_URI"):
                mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
            mlflow.set_experiment("hamo-ray")
            self._mlflow = mlflow.start_run(run_name=f"{self.run_dir.name}-{name}")
            if config:
                mlflow.log_params(_flatten(config))

    def log(self, values: dict[str, float], step: int, axis: str = "stage") -> None:
        """Record ``values`` (``"section/name" -> number``) at ``step``; non-finite numbers are kept as is.

        Args:
            values: the scalars.
            step: their x value (the stage, or the global training step).
            axis: what ``step`` counts (``stage``, ``train/step``); W&B plots each section on its axis.
        """
        values = {k: float(v) for k, v in values.items() if v is not None}
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({**values, axis: step})
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def log_steps(self, rows: list[dict[str, float]], section: str = "train") -> None:
        """Record a stage's training steps as ``<section>/<key>``, numbered on from the earlier stages.

        Args:
            rows: one dict per optimizer step (``TrainResult.step_metrics``: loss, lr, tokens_per_s).
            section: ``train`` (behavioural cloning) or ``dpo`` (ETO); each has its own step count.
        """
        step = self._next_step.get(section, 0)
        for row in rows:
            self.log({f"{section}/{k}": v for k, v in row.items()}, step=step, axis=f"{section}/step")
            step += 1
        self._next_step[section] = step

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()
            self._mlflow = None


def stage_scalars(result) -> dict[str, float]:
    """What a committed ``StageResult`` records: scores per domain, budget, memory size, loss, phase times.

    With ``method.release`` also the release figures (``release/replayed``, ``release/released``, ...).
    """
    values: dict[str, float] = {f"score/{d}": v for d, v in result.scores.items()}
    values.update({f"seconds/{phase}": v for phase, v in result.seconds.items()})
    values.update({f"release/{k}": v for k, v in result.release.items()})
    values.update({f"distil/{k}": v for k, v in result.distil.items()})
    values["stage/budget"] = result.budget
    values["stage/trajectories"] = result.num_trajectories
    values["memory/cards"] = result.num_cards
    if result.train_loss is not None:
        values["stage/train_loss"] = result.train_loss
    return values


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = str(value)[:250]  # MLflow caps parameter values
    return out


def read_scalars(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``path``: ``tag -> [(step, value), ...]``.

    Reads the files with TensorBoard's own record format (through ``tensorboardX``'s protobufs), so a test or
    a report can check what a run recorded without the ``tensorboard`` package.
    """
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for file in sorted(Path(path).rglob("events.out.tfevents.*")):
        data = file.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            record = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4  # length, its crc, the record, its crc
            event = event_pb2.Event()
            event.ParseFromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
