"""What crosses the process boundary between the driver and the training workers: frozen dataclasses.

The driver builds a job (``trainer.stage_job``), an engine (``group.make_group``: Ray Train or Ray
actors) sends it to every worker as it is (pickled by Ray), each worker runs the loop on it
(``loop.run_stage``, with the loss its ``objective`` names in ``objectives.py``), and rank 0 sends
back a :class:`StageOutput`; the driver writes its files and returns the :class:`TrainResult`::

    job = stage_job(tcfg, base_path, ray.put(examples), out_dir, lengths, seed=3)   # a StageJob, "bc"
    result = group.train(job)                          # TrainResult; the adapter is in out_dir
    dpo = stage_job(tcfg, ..., objective="dpo", options={"beta": 0.1})   # the DPO loss and its settings

This module imports nothing of the package but the config-derived precision and strategy
(``deepspeed.py``): both sides import it, it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hamo_ray.training.examples import Example


@dataclass(frozen=True)
class ModelSpec:
    """What a worker loads; two stages with equal specs share the loaded base model."""

    base_path: str
    lora: bool = True
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    bf16: bool = False
    gradient_checkpointing: bool = False
    packed: bool = True
    liger: bool = False
    fused: bool = False  # fused LoRA linear, RMSNorm and loss (fused.py)
    compile: bool = False  # torch.compile each decoder layer (dynamic shapes)

    @classmethod
    def from_config(cls, tcfg: Any, base_path: str, lora: bool = True) -> ModelSpec:
        """The spec of ``base_path`` under a ``TrainConfig``."""
        from hamo_ray.training.deepspeed import use_bf16

        return cls(
            base_path=str(base_path),
            lora=lora,
            lora_r=tcfg.lora_r,
            lora_alpha=tcfg.lora_alpha,
            lora_dropout=tcfg.lora_dropout,
            target_modules=tuple(tcfg.target_modules),
            bf16=use_bf16(tcfg),
            gradient_checkpointing=tcfg.gradient_checkpointing,
            packed=tcfg.packing,
            liger=tcfg.liger and tcfg.use_gpu,
            fused=_fused(tcfg),
            compile=tcfg.compile,
        )


def _fused(tcfg: Any) -> bool:
    """``train.fused`` (None: on GPU), never under ZeRO-3 (its parameter gathering needs the modules' calls)."""
    from hamo_ray.training.deepspeed import resolve_strategy

    fused = tcfg.use_gpu if tcfg.fused is None else tcfg.fused
    return fused and not (tcfg.zero_stage == 3 and resolve_strategy(tcfg) == "deepspeed")


@dataclass(frozen=True)
class StepConfig:
    """The optimisation settings of one stage (from ``TrainConfig`` and the call's overrides)."""

    strategy: str = "ddp"  # "ddp" or "deepspeed"
    lr: float = 2e-4
    weight_decay: float = 0.0
    grad_accum_steps: int = 1
    ds_config: dict[str, Any] = field(default_factory=dict)  # DeepSpeed's own config (deepspeed.py)


@dataclass(frozen=True)
class StageJob:
    """One training stage as every worker runs it: what to load, how to step and batch, the data, the loss.

    ``examples`` is a ``ray.ObjectRef`` of the stage's rows (one copy in the object store for all
    workers) or the rows themselves: ``Example`` objects for behavioural cloning, :class:`EncodedPair`
    objects for DPO (each row has ``tokens``). ``objective`` names the loss in ``objectives.py``'s
    registry, ``options`` its settings (DPO: ``beta``). ``out_dir`` is the driver's: the workers never
    write it.
    """

    spec: ModelSpec
    step: StepConfig
    examples: Any
    out_dir: str
    batch_size: int  # examples per padded micro-batch
    pack_tokens: int  # tokens per packed micro-batch; 0: the worker chooses for its device (packing.py)
    bucket_pool: int
    epochs: int
    seed: int = 0
    pad_id: int = 0
    init_adapter: str | None = None  # the previous stage's adapter folder; None: a fresh LoRA
    reuse: bool = True  # the loaded model may serve this stage (False: reload; the stage changes it in place)
    name: str = "train"  # in the logs
    objective: str = "bc"  # the loss (objectives.py): "bc", "dpo" (init_adapter: the start and the reference)
    options: dict[str, float] = field(default_factory=dict)  # the objective's settings (DPO: beta)

    @property
    def label(self) -> str:
        """The job in messages: its name, prefixed by its objective unless that is behavioural cloning."""
        return self.name if self.objective == "bc" else f"{self.objective} {self.name}"


@dataclass(frozen=True)
class EncodedPair:
    """One (chosen, rejected) trajectory pair, each side its tokenised steps (``dpo.encode_pairs``)."""

    chosen: tuple[Example, ...]
    rejected: tuple[Example, ...]

    @property
    def tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.chosen + self.rejected)


@dataclass(frozen=True)
class TrainResult:
    path: str
    loss: float  # mean loss of the last epoch
    losses: list[float]  # mean loss per epoch
    tokens: int  # trained (non-padding) tokens over all epochs
    seconds: float  # the training loop (steps only)
    padding: float  # fraction of padded positions
    startup_s: float = 0.0  # this stage's set-up before its first step (workers, model, adapter, engine)
    steps: int = 0  # optimizer micro-steps per rank over all epochs
    accuracy: list[float] | None = None  # DPO: share of pairs whose margin is positive, per epoch
    peak_gib: float = 0.0  # rank 0's peak GPU memory in the stage (0 on CPU)
    # one row per optimizer step (rank 0): loss, lr, tokens_per_s (all ranks' tokens / rank 0's step time)
    step_metrics: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class StageOutput:
    """What rank 0 sends back from a stage: the trained weights' files and the stage's figures.

    ``result.path`` is empty and ``result.startup_s`` the worker's own set-up until the driver has
    written ``files`` (``{file name: bytes}``) to the job's ``out_dir`` and timed the whole call.
    """

    files: dict[str, bytes]
    result: TrainResult
