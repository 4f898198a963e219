"""The embedded default backbone: built once from held-out expert data, then cached.

Model weights cannot be downloaded on our machines, so with ``model.path=embedded`` the project
builds its own backbone: expert trajectories of the *pre-training split* (``backbone.split``,
ScienceWorld's dev variations: no stage and no test set uses them) are rolled out, a byte-level
BPE tokenizer is trained on their prompts, and a tiny Qwen3-architecture LM is trained on them by
behavioural cloning in the shared prompt format, a fraction of the examples carrying injected
experience (so that the base model has seen the format HaMo uses). That experience comes from the
memory pipeline itself (``hamo_ray.memory.pipeline``: the outline distiller, the embedding model,
LanceDB retrieval that never returns a trajectory's own card), into a throw-away memory beside
the build. The result is a plain Hugging Face folder under ``backbone.cache_dir/<key>``; the key
hashes every setting it depends on, so a second run reuses it and a changed setting rebuilds it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import random
import shutil
import time
from pathlib import Path

from hamo_ray.config import HamoConfig
from hamo_ray.prompting import build_messages, first_user_message, format_fingerprint
from hamo_ray.types import Card, Trajectory

logger = logging.getLogger(__name__)

BUILD_VERSION = 2  # bump when the build procedure changes


def backbone_key(cfg: HamoConfig) -> str:
    payload = {
        "v": BUILD_VERSION,
        "backbone": cfg.backbone.model_dump(mode="json", exclude={"cache_dir"}),
        "domains": {d: sorted(cfg.task_types(d)) for d in cfg.domains()},
        "simplifications": cfg.env.scienceworld.simplifications,
        "prompt": cfg.prompt.model_dump(mode="json"),
        # the rendered prompt text, not only the switches that select it
        "prompt_format": format_fingerprint(cfg.prompt, cfg.domains()),
        "template_kwargs": cfg.model.template_kwargs(),
        "top_k": cfg.memory.top_k,
        "embedding_model": cfg.memory.embedding_model,
        "max_seq_len": cfg.train.max_seq_len,
        "example_format": cfg.train.example_format,
        "prompt_budget": cfg.prompt_budget,
        "seed": 0,
    }
    # The data behind a domain's experts, where a setting changes it (not in the key before: kept out for
    # ScienceWorld-only configs so that their cached backbones stay valid).
    ws, alf = cfg.env.webshop, cfg.env.alfworld
    if "webshop" in cfg.domains():
        payload["webshop"] = [ws.backend, ws.products, ws.seed, ws.ids]
    if "alfworld" in cfg.domains():
        payload["alfworld"] = [alf.games, alf.seed, alf.games_per_task]
    return hashlib.sha1(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def backbone_path(cfg: HamoConfig) -> Path:
    return Path(cfg.backbone.cache_dir).expanduser() / f"{'-'.join(cfg.domains())}-{backbone_key(cfg)}"


def pretraining_experience(
    trajs: list[Trajectory], cfg: HamoConfig, memory_dir: Path, fraction: float, seed: int
) -> dict[str, list[Card]]:
    """Injected cards for a ``fraction`` of the trajectories: the top-k *other* cards of their memory.

    The trajectories go through the stage pipeline (outline distiller: no LLM endpoint exists
    before the backbone does) into a LanceDB memory at ``memory_dir``; each chosen trajectory gets
    what training-time retrieval gives a stage's examples (``training_experience``).

    Args:
        trajs: the build's expert trajectories.
        cfg: the run's config (``memory``: embedding model, ``top_k``).
        memory_dir: a fresh folder for the build's memory.
        fraction: the share of trajectories that carry experience.
        seed: picks that share.

    Returns:
        Trajectory id -> injected cards, for the chosen trajectories only.
    """
    from hamo_ray.memory.pipeline import build_cards_dataset, write_cards_report
    from hamo_ray.memory.recall import training_experience
    from hamo_ray.memory.store import MemoryStore

    mcfg = cfg.memory.model_copy(update={"distiller": "outline", "storage_options": {}})
    store = MemoryStore.from_config(str(memory_dir), mcfg)
    write_cards_report(build_cards_dataset(trajs, 0, mcfg, store=store), store)
    rng = random.Random(seed)
    chosen = [t for t in trajs if rng.random() < fraction]
    return training_experience(store, chosen, mcfg.top_k)


def _corpus(trajs: list[Trajectory], experience: dict[str, list[Card]], cfg: HamoConfig) -> list[str]:
    texts = []
    for t in trajs:
        texts.append(first_user_message(t.goal, t.init_obs, experience.get(t.id, []), cfg.prompt))
        texts.extend(t.actions)
        texts.extend(t.observations)
    return texts


def ensure_backbone(cfg: HamoConfig, run_expert) -> Path:
    """Return the cached embedded backbone for ``cfg``, building it first if needed.

    Args:
        cfg: the run's config (backbone, env, prompt and memory settings; every domain of the stream).
        run_expert: ``(domain, tasks) -> list[Trajectory]``, rolling out expert episodes (an ``EnvPool``).

    Returns:
        The backbone's Hugging Face folder.
    """
    path = backbone_path(cfg)
    if (path / "BUILD_DONE").exists():
        logger.info("backbone: reusing cached %s", path)
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Two runs needing the same backbone at once (a sweep, a second job): one builds, the other waits.
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "BUILD_DONE").exists():
            logger.info("backbone: built meanwhile by another run: %s", path)
            return path
        return _build(cfg, run_expert, path)


def _build(cfg: HamoConfig, run_expert, path: Path) -> Path:
    from transformers import AutoTokenizer

    from hamo_ray.backbones.tiny_lm import init_qwen3, save_backbone, train_tokenizer
    from hamo_ray.envs import get_domain
    from hamo_ray.training.examples import build_examples, example_options
    from hamo_ray.training.trainer import train_model

    start = time.time()
    bcfg = cfg.backbone
    logger.info("backbone: building %s from split %r", path.name, bcfg.split)
    trajs = []
    for name in cfg.domains():
        domain = get_domain(name, cfg.env)
        limit = cfg.backbone_per_task(name)
        tasks = [t for tt in cfg.task_types(name) for t in domain.tasks(bcfg.split, tt, limit=limit)]
        logger.info("backbone: %d expert episodes of %s", len(tasks), name)
        trajs += [t for t in run_expert(name, tasks) if t.error is None and t.actions and t.score > 0]
    if not trajs:
        raise RuntimeError("backbone: no expert trajectory could be collected")
    staging = path.with_name(path.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    experience = pretraining_experience(trajs, cfg, staging / "memory", bcfg.experience_fraction, seed=0)
    tokenizer = train_tokenizer(_corpus(trajs, experience, cfg), bcfg.vocab_size)
    model = init_qwen3(
        bcfg, tokenizer, max_position_embeddings=max(cfg.model.max_model_len, cfg.train.max_seq_len)
    )
    init_dir = save_backbone(model, tokenizer, staging / "init")
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    examples = build_examples(
        trajs, experience, tokenizer, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
        **example_options(cfg),
    )  # fmt: skip
    n_tokens = sum(len(e.input_ids) for e in examples)
    logger.info(
        "backbone: %s params, %d examples, %d tokens/epoch, %d epochs",
        f"{sum(p.numel() for p in model.parameters()):,}",
        len(examples),
        n_tokens,
        bcfg.epochs,
    )
    result = train_model(
        str(init_dir),
        examples,
        staging / "model",
        cfg.train.model_copy(update={"epochs": bcfg.epochs, "lr": bcfg.lr, "batch_size": bcfg.batch_size}),
        pad_id=tokenizer.pad_token_id,
        lora=False,
        name="backbone",
    )
    tokenizer.save_pretrained(staging / "model")
    (staging / "model" / "build.json").write_text(
        json.dumps(
            {
                "key": backbone_key(cfg),
                "trajectories": len(trajs),
                "examples": len(examples),
                "losses": result.losses,
                "seconds": time.time() - start,
                "example_messages": build_messages(trajs[0].goal, trajs[0].init_obs, [], [], [], cfg.prompt),
            },
            indent=1,
        )
    )
    shutil.rmtree(path, ignore_errors=True)
    (staging / "model").rename(path)
    shutil.rmtree(staging, ignore_errors=True)
    (path / "BUILD_DONE").write_text(time.strftime("%Y-%m-%dT%H:%M:%S"))
    logger.info("backbone: built in %.0fs (final loss %.3f) at %s", time.time() - start, result.loss, path)
    return path
