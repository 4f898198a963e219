"""A dry run of a config: data sources, rendered prompts with token counts, and a resource plan.

No GPU, no Ray started, no episode: per domain it loads one task (one ``reset``), nothing more::

    python jobs/stream.py --config jobs/configs/paper-qwen3-8b-cross.yaml --dry-run

Its second line says who can reach the endpoint (``serve.host``, whether an API key guards it).

1. **Data sources** (``hamo_ray.envs.sources``): ScienceWorld's jar and Java, ALFWorld's games,
   WebShop's backend (the env server answers), the expert files (imported and validated). A missing
   one raises ``DataSourceError`` naming the setting and the path or URL (exit status 2).
2. **Prompts**, per domain, through the code training and inference use: one training example
   (``hamo_ray.training.examples.trajectory_examples``, the last step of an expert trajectory, so the
   most history) and one inference prompt (``hamo_ray.prompting.build_messages`` + the chat template,
   as the rollout sends it), with injected cards where the method uses them (cards distilled from the
   same trajectory, ``memory.top_k`` of them, to size the block). Token counts are printed against
   ``train.max_seq_len`` and ``model.max_model_len`` (minus ``rollout.max_tokens``), with the tokens the
   trajectory's examples hold in all (``train.example_format``). The tokenizer is ``model.path``'s, with
   ``model.chat_template`` when set; the embedded backbone's tokenizer is trained when the backbone is
   first built, so before that the prompts are shown with character counts only. The expert trajectory
   comes from the expert file (``env.expert_source=file``) or from the simulator's expert plan of the
   loaded task (its first action only: no step is run).
3. **Resources**: what the config asks for at its peak (the policy server stays up while a stage
   trains; one rollout pool per domain) against what the Ray cluster has (``ray.address`` /
   ``RAY_ADDRESS``, joined read-only) or, without one, this machine. A shortfall is printed, not
   raised (the dry run also serves to plan a cluster).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from hamo_ray.config import HamoConfig
from hamo_ray.types import Trajectory

logger = logging.getLogger(__name__)


@dataclass
class DryRunReport:
    """What the dry run found; ``warnings`` hold over-long prompts and resource shortfalls."""

    sources: list[str] = field(default_factory=list)
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> {"train": n, "infer": n}
    requested: dict[str, float] = field(default_factory=dict)
    available: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _tokenizer(cfg: HamoConfig, out: Callable[[str], None]):
    from transformers import AutoTokenizer

    path = cfg.model.path
    if path == "embedded":
        from hamo_ray.backbones.toy import backbone_path

        built = backbone_path(cfg)
        if not (built / "BUILD_DONE").exists():
            out(
                f"tokenizer: the embedded backbone is not built yet ({built}); its tokenizer is trained on "
                "the expert data when the first run builds it, so prompts are shown with character counts"
            )
            return None
        path = str(built)
    out(f"tokenizer: {path}")
    from hamo_ray.backbones.sources import is_model_source, load_source_tokenizer
    from hamo_ray.chat import set_chat_template

    if cfg.model.chat_template is not None:  # training and the server render with it instead
        out(f"chat template: model.chat_template {cfg.model.chat_template}")
    if is_model_source(path):  # a GGUF source: its converted folder's tokenizer, else the GGUF's own
        tokenizer = load_source_tokenizer(path, cfg.model.cache_dir)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return set_chat_template(tokenizer, cfg.model.template_text())


def _one_task(cfg: HamoConfig, name: str) -> tuple[Trajectory, Trajectory]:
    """Load one task of ``name``; returns (the loaded task's start, whose prompt is the inference prompt,
    an expert trajectory for the training example: the file's first usable one, else the loaded task's
    expert plan)."""
    from hamo_ray.envs import get_domain

    domain = get_domain(name, cfg.env)
    expert = None
    if cfg.env.expert_source == "file":
        from hamo_ray.envs.expert_data import train_experts_by_type

        usable = [t for ts in train_experts_by_type(cfg, name).values() for t in ts]
        expert = usable[0] if usable else None
    split = "test" if expert is not None else "train"
    task_type = cfg.task_types(name)[0]
    found = domain.tasks(split, task_type, limit=1)
    if not found:
        raise RuntimeError(f"{name}: no {split} task of type {task_type}")
    env = domain.make_env()
    try:
        goal, init_obs = env.reset(found[0])
        loaded = Trajectory(task=found[0], goal=goal, init_obs=init_obs, source="expert")
        if expert is None:  # the simulator's expert plan of the loaded task; nothing is stepped
            plan = env.expert_actions()[:1]
            expert = loaded.model_copy(update={"actions": plan, "observations": [""] * len(plan)})
    finally:
        env.close()
    return loaded, expert


def _cards(traj: Trajectory, k: int) -> list:
    from hamo_ray.memory.distill import card_from_trajectory, outline_from_trajectory

    card = card_from_trajectory(traj, 1, outline_from_trajectory(traj))
    return [card] * k


def _render(cfg: HamoConfig, name: str, tokenizer, out: Callable[[str], None], report: DryRunReport) -> None:
    from hamo_ray.prompting import build_messages, encode_chat, step_example

    loaded, expert = _one_task(cfg, name)
    m, pcfg = cfg.method, cfg.prompt
    train_cards = _cards(expert, cfg.memory.top_k) if m.conditioning and expert.actions else []
    infer_cards = _cards(expert, cfg.memory.top_k) if m.retrieval and expert.actions else []
    kwargs = cfg.model.template_kwargs()  # the template variables training and the server render with
    messages = build_messages(loaded.goal, loaded.init_obs, infer_cards, [], [], pcfg, domain=name)
    out(
        f"\n=== {name}: expert trajectory {expert.id} ({len(expert.actions)} actions); loaded {loaded.task.id}"
    )
    counts: dict[str, int] = {}
    if expert.actions:
        if tokenizer is not None:
            from hamo_ray.training.examples import example_options, trajectory_examples

            examples = trajectory_examples(
                expert, train_cards, tokenizer, pcfg, 10**9, kwargs, **example_options(cfg)
            )
            longest = max(len(e.input_ids) for e in examples)
            total = sum(len(e.input_ids) for e in examples)  # what one epoch computes for this trajectory
            counts["train"] = longest
            last = examples[-1]
            over = [i for i, e in enumerate(examples) if len(e.input_ids) > cfg.train.max_seq_len]
            out(
                f"--- training example {len(examples)}/{len(examples)} ({cfg.train.example_format} format): "
                f"{len(last.input_ids)} tokens (longest {longest}, {total} in all) / train.max_seq_len "
                f"{cfg.train.max_seq_len}"
            )
            out(tokenizer.decode(last.input_ids))
            target = [t for t in last.labels if t != -100]
            out(f"--- (loss on {len(target)} tokens: {tokenizer.decode(target)!r})")
            if over:
                report.warnings.append(
                    f"{name}: {len(over)} of {len(examples)} training examples exceed train.max_seq_len "
                    f"{cfg.train.max_seq_len} (training drops them)"
                )
        else:
            k = len(expert.actions) - 1
            last, reply = step_example(expert, k, train_cards, pcfg)
            out(f"--- training example, step {k + 1}: {sum(len(x['content']) for x in last)} characters")
            for msg in last:
                out(f"[{msg['role']}] {msg['content']}")
            out(f"[target] {reply}")
    budget = cfg.prompt_budget
    if tokenizer is not None:
        ids = encode_chat(tokenizer, messages, True, kwargs)
        counts["infer"] = len(ids)
        out(
            f"--- inference prompt, first turn: {len(ids)} tokens / model.max_model_len {cfg.model.max_model_len} "
            f"- rollout.max_tokens {cfg.rollout.max_tokens} = {budget}"
        )
        out(tokenizer.decode(ids))
        if len(ids) > budget:
            report.warnings.append(f"{name}: the first inference prompt ({len(ids)} tokens) exceeds {budget}")
    else:
        out(f"--- inference prompt, first turn: {sum(len(x['content']) for x in messages)} characters")
        for msg in messages:
            out(f"[{msg['role']}] {msg['content']}")
    report.tokens[name] = counts


def _available(cfg: HamoConfig, out: Callable[[str], None]) -> dict[str, float]:
    """What the run would get: the cluster it would join (read-only), else a private local Ray."""
    from hamo_ray.run.cluster import cluster_address, local_cpus

    address = cluster_address(cfg.ray)
    if address:
        import ray

        try:
            ray.init(address=address, configure_logging=False, log_to_driver=False)
            try:
                res = ray.cluster_resources()
            finally:
                ray.shutdown()
            out(f"resources: the Ray cluster at {address}")
            return {"CPU": float(res.get("CPU", 0)), "GPU": float(res.get("GPU", 0))}
        except ConnectionError as err:
            if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
                raise
            out(f"resources: no Ray cluster answers at {address} ({err}); a run would start a local one")
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch / no CUDA: no GPU
        gpus = 0
    out(
        f"resources: no Ray cluster to join; a run starts a private local Ray with {local_cpus(cfg.ray)} "
        f"logical CPUs (ray.num_cpus, else 4 x the {os.cpu_count()} cores) and this machine's {gpus} GPUs"
    )
    return {"CPU": float(local_cpus(cfg.ray)), "GPU": float(gpus)}


def _card_gib() -> float | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / 2**30
    except Exception:  # noqa: BLE001 - no torch / no CUDA
        pass
    return None


def _plan(cfg: HamoConfig, out: Callable[[str], None], report: DryRunReport) -> None:
    s, t, r = cfg.serve, cfg.train, cfg.rollout
    serve_gpu = s.num_replicas * (s.num_gpus or 0.0)
    serve_cpu = s.num_replicas * s.num_cpus + (s.harness_num_cpus if cfg.method.uses_memory else 0.0)
    train_gpu = float(t.num_workers) if (t.use_gpu and cfg.method.train) else 0.0
    train_cpu = t.num_workers * t.cpus_per_worker if cfg.method.train else 0.0
    pools = len(cfg.domains())
    roll_cpu = pools * r.num_workers * r.cpus_per_worker
    out("\n=== resource plan (peak: the server stays up while a stage trains; one rollout pool per domain)")
    out(f"serving : {s.num_replicas} replicas x ({s.num_gpus} GPU, {s.num_cpus} CPU), tp {s.tensor_parallel_size}"
        f" -> {serve_gpu:g} GPU, {serve_cpu:g} CPU")  # fmt: skip
    out(f"training: {t.num_workers} workers x ({'1 GPU' if t.use_gpu else 'no GPU'}, {t.cpus_per_worker} CPU)"
        f" -> {train_gpu:g} GPU, {train_cpu:g} CPU" + ("" if cfg.method.train else " (method does not train)"))  # fmt: skip
    out(f"rollout : {pools} pool(s) x {r.num_workers} actors x {r.cpus_per_worker} CPU -> {roll_cpu:g} CPU")
    need = {"GPU": serve_gpu + train_gpu, "CPU": serve_cpu + train_cpu + roll_cpu}
    have = _available(cfg, out)
    if need["GPU"]:  # memory per GPU (hamo_ray.run.gpu_plan), on this machine's cards or 80 GiB ones
        from hamo_ray.run.gpu_plan import format_plan, gpu_plan

        plan = gpu_plan(cfg, card_gib=_card_gib() or 80.0)
        out(format_plan(plan))
        report.warnings += [f"gpu plan: {p}" for p in plan.problems]
    report.requested, report.available = need, have
    for key in ("GPU", "CPU"):
        verdict = "ok" if need[key] <= have[key] else "SHORT"
        out(f"{key:<8}: asks {need[key]:g} at peak, has {have[key]:g}  {verdict}")
        if verdict == "SHORT":
            report.warnings.append(
                f"resources: the config asks for {need[key]:g} {key} at peak; {have[key]:g} available"
            )


def _exposure(cfg: HamoConfig) -> str:
    """Who can reach the endpoint. A host beyond loopback without a key never gets here: loading the
    config refuses it (``ServeConfig``), naming ``serve.api_key`` and ``HAMO_API_KEY``."""
    from hamo_ray.config import is_loopback

    s = cfg.serve
    where = "this machine only" if is_loopback(s.host) else "other machines too"
    if not s.api_key:
        return f"endpoint: {s.host}:{s.port} ({where}), no API key: every route open to local users"
    probes = "/health and /metrics too" if s.auth_probes else "/health and /metrics open (serve.auth_probes)"
    return f"endpoint: {s.host}:{s.port} ({where}), every route behind the API key ({probes})"


def dry_run(cfg: HamoConfig, out: Callable[[str], None] = print) -> DryRunReport:
    """Check sources, render prompts per domain, plan resources; print everything through ``out``.

    Args:
        cfg: the run's configuration.
        out: where the lines go (``print`` from the CLI).

    Returns:
        The report (token counts, requested/available resources, warnings).

    Raises:
        ConfigError: a missing data source (``DataSourceError``), a malformed expert file
            (``ExpertDataError``), a missing model path or an unknown task type, named in the message.
    """
    from hamo_ray.envs import get_domain
    from hamo_ray.envs.sources import check_data_sources
    from hamo_ray.run.stream import check_action_constraint, check_model_path

    report = DryRunReport()
    p = cfg.protocol
    out(f"dry run: method {cfg.method.name}, {p.kind} over {cfg.domains()}, {p.stages} stages, "
        f"experts from {cfg.env.expert_source}, model {cfg.model.path}")  # fmt: skip
    out(_exposure(cfg))
    check_model_path(cfg.model.path)
    domains = {name: get_domain(name, cfg.env) for name in cfg.domains()}
    for name, domain in domains.items():
        domain.check_task_types(cfg.task_types(name))
    if cfg.rollout.constrain_actions:
        free = check_action_constraint(cfg, domains)
        out(f"replies constrained to the admissible commands in {sorted(set(domains) - set(free))}")
    out("\n=== data sources")
    for source in check_data_sources(cfg):
        report.sources.append(source.line())
        out(source.line())
    out("")
    tokenizer = _tokenizer(cfg, out)
    for name in cfg.domains():
        _render(cfg, name, tokenizer, out, report)
    _plan(cfg, out, report)
    out("\n=== " + ("warnings:\n" + "\n".join(report.warnings) if report.warnings else "no warnings"))
    return report
