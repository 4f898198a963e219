"""The stream: the single controller that runs a whole continual-learning run, stage by stage.

For each stage t (METHOD.md, DESIGN.md "Data flow of one stage"):
collect expert trajectories -> distil into cards (Ray Data -> LanceDB) -> coverage selection ->
replay -> experience-conditioned LoRA training (Ray Train) -> publish the adapter under a new name
and prove it live -> evaluate every domain's test set against the endpoint -> commit.

This module and ``jobs/`` are the only places that wait on Ray results. Usage::

    cfg = load_config("jobs/configs/tiny.yaml", ["train.epochs=1"])
    results = Stream(cfg).run()
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.rollout.policy import PolicySpec
from hamo_ray.run_state import RunFolder
from hamo_ray.types import StageResult, TaskSpec, Trajectory

logger = logging.getLogger(__name__)


def split_stages(tasks_by_type: dict[str, list[TaskSpec]], num_stages: int) -> list[list[TaskSpec]]:
    """Sample-disjoint stage subsets, each covering every task type (round-robin within a type)."""
    stages: list[list[TaskSpec]] = [[] for _ in range(num_stages)]
    for tasks in tasks_by_type.values():
        for i, task in enumerate(tasks):
            stages[i % num_stages].append(task)
    return stages


def check_model_path(path: str) -> None:
    """A local-looking model path must exist; a hub id (``org/name``) is left to ``from_pretrained``."""
    if path == "embedded":
        return
    looks_local = path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or path.count("/") != 1
    if looks_local and not Path(path).expanduser().exists():
        raise ConfigError(
            f"model.path: {path!r} does not exist (use an existing HF folder, a hub id, or 'embedded')"
        )


class Stream:
    """Runs the stages of one run folder; resumes after the last committed stage."""

    def __init__(self, cfg: HamoConfig, config_name: str = "run") -> None:
        from hamo_ray.envs import get_domain

        self.cfg = cfg
        self.domain = get_domain(cfg.env.domain, cfg.env)
        self.domain.check_task_types(cfg.env.task_types)
        check_model_path(cfg.model.path)
        run_id = cfg.run.id or f"{config_name}-{cfg.method.name}-s{cfg.run.seed}"
        self.folder = RunFolder(Path(cfg.run.root) / run_id, cfg)
        p = cfg.protocol
        self.stage_tasks = split_stages(
            {tt: self.domain.tasks("train", tt, limit=p.train_per_task) for tt in cfg.env.task_types},
            p.num_stages,
        )
        self.test_tasks = {
            cfg.env.domain: [
                t for tt in cfg.env.task_types for t in self.domain.tasks("test", tt, limit=p.test_per_task)
            ]
        }

    # -- the whole run -------------------------------------------------------------------------
    def run(self) -> list[StageResult]:
        cfg = self.cfg
        done = self.folder.prepare()
        if len(done) >= cfg.protocol.num_stages:
            logger.info("run %s already holds all %d stages; nothing to do", self.folder.path, len(done))
            return done
        self._start_ray()
        from hamo_ray.rollout.pool import EnvPool

        pool = EnvPool(cfg.env.domain, cfg.env, cfg.prompt, cfg.rollout)
        try:
            model_path = self._backbone(pool)
            base_url, harness_url = self._start_serving(model_path)
            for stage in range(len(done) + 1, cfg.protocol.num_stages + 1):
                result = self._stage(stage, done, pool, model_path, base_url, harness_url)
                done.append(result)
                self.folder.commit(result)
                logger.info("stage %d committed: scores %s", stage, result.scores)
        finally:
            pool.shutdown()
            self._stop_serving()
        return done

    def _start_ray(self) -> None:
        import os

        import ray

        if ray.is_initialized():
            return
        address = self.cfg.ray.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, configure_logging=False)
        else:
            cpus = self.cfg.ray.num_cpus or max(4, 2 * (os.cpu_count() or 1))
            ray.init(num_cpus=cpus, include_dashboard=False, configure_logging=False)

    def _backbone(self, pool) -> str:
        if self.cfg.model.path != "embedded":
            return self.cfg.model.path
        from hamo_ray.training.backbone import ensure_backbone

        t0 = time.time()
        path = ensure_backbone(self.cfg, pool, self.folder.path / "train")
        self.folder.timings["backbone"] = time.time() - t0
        return str(path)

    def _start_serving(self, model_path: str) -> tuple[str, str | None]:
        from ray import serve

        from hamo_ray.serving import start_policy_server, wait_healthy
        from hamo_ray.serving.harness import build_harness_app

        cfg = self.cfg
        base_url = start_policy_server(
            model_path, cfg.model, cfg.serve, adapter_root=str(self.folder.adapters_dir)
        )
        harness_url = None
        if cfg.method.uses_memory:
            app = build_harness_app(self.folder.memory_uri, cfg.memory.table, cfg.memory.embedding_model)
            serve.run(app, name=f"{cfg.serve.app_name}-harness", route_prefix="/harness")
            harness_url = f"{base_url}/harness"
            wait_healthy(harness_url)
        # Adapters of committed stages (a resumed run) are published again under their names.
        for result in self.folder.stages():
            if result.adapter:
                self._publish(base_url, result.adapter_name, self.folder.path / result.adapter)
        return base_url, harness_url

    def _stop_serving(self) -> None:
        from ray import serve

        from hamo_ray.serving import shutdown_policy_server

        try:
            if self.cfg.method.uses_memory:
                serve.delete(f"{self.cfg.serve.app_name}-harness")
            shutdown_policy_server(self.cfg.serve)
        except Exception:
            logger.debug("serve shutdown failed", exc_info=True)

    def _publish(self, base_url: str, name: str, path: Path) -> dict:
        from hamo_ray.serving import publish_adapter

        return publish_adapter(
            base_url, name, str(path), self.cfg.serve.probe_prompt, self.cfg.serve.probe_tokens
        )

    # -- one stage ----------------------------------------------------------------------------
    def _stage(
        self,
        stage: int,
        done: list[StageResult],
        pool,
        model_path: str,
        base_url: str,
        harness_url: str | None,
    ) -> StageResult:
        cfg, m = self.cfg, self.cfg.method
        secs: dict[str, float] = {}
        tick = time.time()
        logger.info("=== stage %d/%d (%s) ===", stage, cfg.protocol.num_stages, m.name)

        trajs = self._collect(stage, pool)
        secs["collect"] = time.time() - tick

        tick = time.time()
        store = self.folder.store(cfg) if m.uses_memory else None
        if store is not None:
            from hamo_ray.memory.pipeline import build_cards_dataset, write_cards

            added = write_cards(build_cards_dataset(trajs, stage, cfg.memory), store)
            logger.info("distil: %d new cards (memory holds %d)", added, store.count())
        secs["distil"] = time.time() - tick

        tick = time.time()
        anchors, budget = self._select(stage, trajs, store)
        replay = self._replay(stage, done, len(anchors)) if m.replay and m.train else []
        secs["select"] = time.time() - tick

        adapter = adapter_name = None
        loss = None
        if m.train:
            tick = time.time()
            prev = self.folder.path / done[-1].adapter if done and done[-1].adapter else None
            adapter, loss = self._train(stage, anchors + replay, store, model_path, prev)
            secs["train"] = time.time() - tick
            tick = time.time()
            adapter_name = f"stage-{stage}"
            self._publish(base_url, adapter_name, self.folder.path / adapter)
            secs["publish"] = time.time() - tick

        tick = time.time()
        scores = self._evaluate(
            stage,
            pool,
            base_url,
            adapter_name or (done[-1].adapter_name if done else None),
            harness_url if m.retrieval else None,
        )
        secs["evaluate"] = time.time() - tick
        return StageResult(
            stage=stage,
            method=m.name,
            num_trajectories=len(trajs),
            num_cards=store.count() if store is not None else 0,
            budget=budget,
            anchors=[t.id for t in anchors],
            replay=[t.id for t in replay],
            adapter=adapter,
            adapter_name=adapter_name,
            train_loss=loss,
            scores=scores,
            seconds=secs,
        )

    def _collect(self, stage: int, pool) -> list[Trajectory]:
        cached = self.folder.load_trajectories(stage)
        if cached is not None:
            logger.info("collect: reusing %d trajectories of stage %d", len(cached), stage)
            return cached
        tasks = self.stage_tasks[stage - 1]
        got = pool.run(tasks, None, desc=f"stage {stage} expert episodes")
        ok = [t for t in got if t.error is None and t.actions and t.score > 0]
        if len(ok) < len(got):
            logger.warning(
                "collect: %d of %d expert episodes failed or scored 0 and are left out",
                len(got) - len(ok),
                len(got),
            )
        if not ok:
            raise RuntimeError(f"stage {stage}: no usable expert trajectory")
        self.folder.save_trajectories(stage, ok)
        return ok

    def _select(self, stage: int, trajs: list[Trajectory], store) -> tuple[list[Trajectory], int]:
        if not self.cfg.method.selection or store is None:
            return trajs, len(trajs)
        from hamo_ray.selection import coverage_select
        from hamo_ray.types import card_id

        ids = [card_id(t.id) for t in trajs]
        result = coverage_select(
            store.vectors(ids), k=self.cfg.selection.k, min_budget=self.cfg.selection.min_budget
        )
        logger.info("select: budget %d of %d (coverage curve %s)", result.budget, len(trajs), result.curve)
        return [trajs[i] for i in result.order], result.budget

    def _replay(self, stage: int, done: list[StageResult], n_anchors: int) -> list[Trajectory]:
        earlier = [
            t for r in done for t in self.folder.load_trajectories(r.stage) or [] if t.id in set(r.anchors)
        ]
        n = min(len(earlier), round(self.cfg.replay.ratio * n_anchors))
        picked = random.Random(self.cfg.run.seed * 1000 + stage).sample(earlier, n) if n else []
        logger.info("replay: %d of %d earlier anchors", len(picked), len(earlier))
        return picked

    def _train(self, stage: int, batch: list[Trajectory], store, model_path: str, prev: Path | None):
        from transformers import AutoTokenizer

        from hamo_ray.training.examples import build_examples
        from hamo_ray.training.trainer import train_model
        from hamo_ray.types import card_id

        cfg = self.cfg
        experience = {}
        if cfg.method.conditioning and store is not None:
            ids = [card_id(t.id) for t in batch]
            # Each example's experience comes from memory M_t, never its own card.
            hits = store.search(
                store.vectors(ids), k=cfg.memory.top_k, exclude_ids=[{i} for i in ids], max_stage=stage
            )
            experience = {t.id: [c for c, _ in h] for t, h in zip(batch, hits, strict=True)}
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        examples = build_examples(batch, experience, tokenizer, cfg.prompt, cfg.train.max_seq_len)
        logger.info(
            "train: %d trajectories -> %d examples (init from %s)",
            len(batch),
            len(examples),
            prev or "fresh LoRA",
        )
        rel = f"adapters/stage-{stage}"
        result = train_model(
            model_path,
            examples,
            self.folder.path / rel,
            cfg.train,
            self.folder.path / "train",
            pad_id=tokenizer.pad_token_id,
            init_adapter=str(prev) if prev else None,
            seed=cfg.run.seed + stage,
            name=f"stage-{stage}",
        )
        logger.info(
            "train: losses %s, %d tokens in %.0fs",
            [round(x, 3) for x in result.losses],
            result.tokens,
            result.seconds,
        )
        return rel, result.loss

    def _evaluate(
        self, stage: int, pool, base_url: str, model: str | None, harness_url: str | None
    ) -> dict[str, float]:
        cfg = self.cfg
        scores = {}
        for domain, tasks in self.test_tasks.items():
            spec = PolicySpec(
                base_url=base_url,
                model=model or cfg.model.name,
                temperature=cfg.rollout.temperature,
                max_tokens=cfg.rollout.max_tokens,
                harness_url=harness_url,
                top_k=cfg.memory.top_k,
                timeout_s=cfg.rollout.request_timeout_s,
                seed=cfg.run.seed,
            )
            trajs = pool.run(tasks, spec, desc=f"stage {stage} evaluation ({domain})")
            self.folder.save_episodes(stage, domain, trajs)
            failed = [t for t in trajs if t.error]
            if failed:
                logger.warning("evaluate: %d episodes failed: %s", len(failed), failed[0].error)
            scores[domain] = sum(t.score for t in trajs) / len(trajs)
        return scores
