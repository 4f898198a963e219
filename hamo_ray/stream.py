"""The stream: the single controller that runs a whole continual-learning run, stage by stage.

For each stage t (METHOD.md, DESIGN.md "Data flow of one stage"):
collect expert trajectories -> distil into cards (Ray Data -> LanceDB) -> coverage selection ->
replay -> experience-conditioned LoRA training (Ray Train) -> publish the adapter under a new name
and prove it live -> evaluate every domain's test set against the endpoint -> commit.

Protocols: ``within_domain`` (one domain's train variations split into sample-disjoint stages,
each covering every task type) and ``cross_domain`` (one stage per domain of ``protocol.order``).
Methods (``method.*``) switch parts of the same loop on and off; there is no second loop.

This module and ``jobs/`` are the only places that wait on Ray results. Usage::

    cfg = load_config("jobs/configs/tiny.yaml", ["train.epochs=1"])
    results = Stream(cfg).run()
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from urllib.parse import urlsplit

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
    """Runs the stages of one run folder; resumes after the last committed stage.

    Args:
        cfg: the run's configuration.
        config_name: used in the default run id ``<config_name>-<method>-s<seed>``.

    Raises:
        ConfigError: an unknown domain or task type, a missing model path, or a run folder that
            cannot be resumed; raised before any work.
    """

    def __init__(self, cfg: HamoConfig, config_name: str = "run") -> None:
        from hamo_ray.envs import get_domain

        self.cfg = cfg
        check_model_path(cfg.model.path)
        p = cfg.protocol
        self.domains = {name: get_domain(name, cfg.env) for name in cfg.domains()}
        for name, domain in self.domains.items():
            domain.check_task_types(cfg.task_types(name))
        self.run_id = cfg.run.id or f"{config_name}-{cfg.method.name}-s{cfg.run.seed}"
        self.folder = RunFolder(Path(cfg.run.root) / self.run_id, cfg)

        def train_tasks(name: str) -> dict[str, list[TaskSpec]]:
            domain = self.domains[name]
            return {tt: domain.tasks("train", tt, limit=p.train_per_task) for tt in cfg.task_types(name)}

        if p.kind == "cross_domain":
            self.stage_domains = list(p.order)
            self.stage_tasks = [[t for ts in train_tasks(d).values() for t in ts] for d in p.order]
        else:
            self.stage_domains = [cfg.env.domain] * p.num_stages
            self.stage_tasks = split_stages(train_tasks(cfg.env.domain), p.num_stages)
        self.test_tasks = {
            name: [t for tt in cfg.task_types(name) for t in domain.tasks("test", tt, limit=p.test_per_task)]
            for name, domain in self.domains.items()
        }
        self._pools: dict = {}
        self._owns_server = True
        self._harness_app: str | None = None
        self._store = None  # an object-store adapter_store: adapters are uploaded, replicas fetch them

    # -- the whole run -------------------------------------------------------------------------
    @property
    def expected_stages(self) -> list[int]:
        first = 0 if self.cfg.protocol.eval_initial else 1
        return list(range(first, self.cfg.protocol.stages + 1))

    @property
    def finished(self) -> bool:
        """Whether the run folder already holds every stage of this run."""
        return {r.stage for r in self.folder.stages()} >= set(self.expected_stages)

    def prepare_backbone(self) -> str:
        """Start Ray if needed and return the backbone path, building the embedded one if needed."""
        self._start_ray()
        try:
            return self._backbone()
        finally:
            for pool in self._pools.values():
                pool.shutdown()
            self._pools.clear()

    def run(self, base_url: str | None = None) -> list[StageResult]:
        """Run (or resume) every stage.

        Args:
            base_url: an already running policy endpoint serving this run's backbone (a sweep shares
                one per backbone); None starts one for this run and stops it at the end.

        Returns:
            The committed stages (stage 0 first when ``protocol.eval_initial``).
        """
        done = self.folder.prepare()
        todo = [s for s in self.expected_stages if s not in {r.stage for r in done}]
        if not todo:
            logger.info("run %s already holds all its stages; nothing to do", self.folder.path)
            return done
        self._start_ray()
        try:
            model_path = self._backbone()
            base_url, harness_url = self._start_serving(model_path, base_url)
            for stage in todo:
                if stage == 0:
                    result = self._initial_evaluation(base_url, harness_url)
                else:
                    result = self._stage(stage, done, model_path, base_url, harness_url)
                done.append(result)
                self.folder.commit(result)
                logger.info("stage %d committed: scores %s", stage, result.scores)
        finally:
            for pool in self._pools.values():
                pool.shutdown()
            self._pools.clear()
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
            # Logical CPUs, oversubscribed: rollout actors, the harness and idle Serve replicas hold
            # CPU shares while they mostly wait; with only the physical count, a cross-domain stream's
            # actors leave no room for the embedding actor and the pipeline stalls.
            # address="local": a Ray of our own even when `ray start` runs a cluster on this machine
            # (joining it takes ray.address=auto or RAY_ADDRESS, as `ray job submit` sets).
            cpus = self.cfg.ray.num_cpus or max(8, 4 * (os.cpu_count() or 1))
            ray.init(address="local", num_cpus=cpus, include_dashboard=False, configure_logging=False)

    def _pool(self, domain: str):
        if domain not in self._pools:
            from hamo_ray.rollout.pool import EnvPool

            self._pools[domain] = EnvPool(domain, self.cfg.env, self.cfg.prompt, self.cfg.rollout)
        return self._pools[domain]

    def _backbone(self) -> str:
        if self.cfg.model.path != "embedded":
            self.folder.backbone = self.cfg.model.path
            return self.cfg.model.path
        from hamo_ray.training.backbone import ensure_backbone

        t0 = time.time()
        path = ensure_backbone(
            self.cfg,
            lambda domain, tasks: self._pool(domain).run(
                tasks, None, desc=f"backbone expert episodes ({domain})"
            ),
            self.folder.path / "train",
        )
        self.folder.timings["backbone"] = time.time() - t0
        self.folder.backbone = str(path)
        return str(path)

    # -- serving -------------------------------------------------------------------------------
    def adapter_name(self, stage: int) -> str:
        """Adapter names are new at every stage; a shared endpoint prefixes them with the run id."""
        return f"stage-{stage}" if self._owns_server else f"{self.run_id}-stage-{stage}"

    def _start_serving(self, model_path: str, base_url: str | None) -> tuple[str, str | None]:
        from ray import serve

        from hamo_ray.serving import start_policy_server, wait_healthy
        from hamo_ray.serving.harness import build_harness_app
        from hamo_ray.serving.objstore import ObjectStore, is_uri

        cfg = self.cfg
        if base_url is None:
            adapter_root = str(self.folder.adapters_dir)
            if is_uri(cfg.serve.adapter_store):  # replicas on any node download from the store
                self._store = ObjectStore(cfg.serve.adapter_store)
                adapter_root = cfg.serve.adapter_store
            base_url = start_policy_server(
                model_path,
                cfg.model,
                cfg.serve,
                adapter_root=adapter_root,
                max_lora_rank=cfg.serve.max_lora_rank,
            )
        else:
            self._owns_server = False
        harness_url = None
        if cfg.method.uses_memory:
            route = "/harness" if self._owns_server else f"/harness-{self.run_id}"
            self._harness_app = f"{cfg.serve.app_name}-harness" + (
                "" if self._owns_server else f"-{self.run_id}"
            )
            app = build_harness_app(self.folder.memory_uri, cfg.memory)
            serve.run(app, name=self._harness_app, route_prefix=route)
            parts = urlsplit(base_url)
            harness_url = f"{parts.scheme}://{parts.netloc}{route}"
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
            if self._harness_app:
                serve.delete(self._harness_app)
            if self._owns_server:
                shutdown_policy_server(self.cfg.serve)
        except Exception:
            logger.debug("serve shutdown failed", exc_info=True)

    def _publish(self, base_url: str, name: str, path: Path) -> dict:
        from hamo_ray.serving import publish_adapter

        if self._store is not None:  # upload unless the store holds the same files; publish its path
            self._store.put(path, path.name)
            path = Path(path.name)
        return publish_adapter(
            base_url, name, str(path), self.cfg.serve.probe_prompt, self.cfg.serve.probe_tokens
        )

    # -- one stage ----------------------------------------------------------------------------
    def _initial_evaluation(self, base_url: str, harness_url: str | None) -> StageResult:
        tick = time.time()
        logger.info("=== stage 0: evaluation before any stage ===")
        scores = self._evaluate(0, base_url, None, harness_url if self.cfg.method.retrieval else None)
        return StageResult(
            stage=0,
            method=self.cfg.method.name,
            domain="",
            num_trajectories=0,
            num_cards=0,
            budget=0,
            anchors=[],
            replay=[],
            adapter=None,
            adapter_name=None,
            train_loss=None,
            scores=scores,
            seconds={"evaluate": time.time() - tick},
        )

    def _stage(
        self, stage: int, done: list[StageResult], model_path: str, base_url: str, harness_url: str | None
    ) -> StageResult:
        cfg, m = self.cfg, self.cfg.method
        domain = self.stage_domains[stage - 1]
        secs: dict[str, float] = {}
        tick = time.time()
        logger.info("=== stage %d/%d (%s, %s) ===", stage, cfg.protocol.stages, domain, m.name)

        trajs = self._collect(stage, domain)
        secs["collect"] = time.time() - tick

        tick = time.time()
        store = self.folder.store(cfg) if m.uses_memory else None
        if store is not None:
            from hamo_ray.memory.pipeline import build_cards_dataset, write_cards_report

            report = write_cards_report(build_cards_dataset(trajs, stage, cfg.memory, store=store), store)
            logger.info(
                "distil: %d new cards, %d rejected, %d distiller fallbacks (memory holds %d)",
                report.added,
                len(report.rejected),
                report.fallbacks,
                store.count(),
            )
            for rejection in report.rejected[:5]:
                logger.warning("distil: rejected %s", rejection)
        secs["distil"] = time.time() - tick

        tick = time.time()
        anchors, budget = self._select(trajs, store)
        replay = self._replay(stage, done, len(anchors)) if m.replay and m.train else []
        secs["select"] = time.time() - tick

        trained = [r for r in done if r.adapter]
        adapter_path = adapter_name = loss = None
        if m.train:
            tick = time.time()
            prev = self.folder.path / trained[-1].adapter if trained else None
            rel = f"adapters/stage-{stage}" + ("-bc" if m.dpo else "")
            adapter_path, loss = self._train(stage, anchors + replay, store, model_path, prev, rel)
            secs["train"] = time.time() - tick
            tick = time.time()
            adapter_name = self.adapter_name(stage) + ("-bc" if m.dpo else "")
            self._publish(base_url, adapter_name, self.folder.path / adapter_path)
            secs["publish"] = time.time() - tick
            if m.dpo:
                tick = time.time()
                adapter_path, adapter_name, loss = self._eto(
                    stage, domain, trajs, model_path, adapter_path, adapter_name, base_url, loss
                )
                secs["dpo"] = time.time() - tick
            if m.release and store is not None:
                self._release(store, anchors)

        tick = time.time()
        scores = self._evaluate(stage, base_url, adapter_name, harness_url if m.retrieval else None)
        secs["evaluate"] = time.time() - tick
        return StageResult(
            stage=stage,
            method=m.name,
            domain=domain,
            num_trajectories=len(trajs),
            num_cards=store.count() if store is not None else 0,
            budget=budget,
            anchors=[t.id for t in anchors],
            replay=[t.id for t in replay],
            adapter=adapter_path,
            adapter_name=adapter_name,
            train_loss=loss,
            scores=scores,
            seconds=secs,
        )

    def _collect(self, stage: int, domain: str) -> list[Trajectory]:
        cached = self.folder.load_trajectories(stage)
        if cached is not None:
            logger.info("collect: reusing %d trajectories of stage %d", len(cached), stage)
            return cached
        tasks = self.stage_tasks[stage - 1]
        got = self._pool(domain).run(tasks, None, desc=f"stage {stage} expert episodes ({domain})")
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

    def _select(self, trajs: list[Trajectory], store) -> tuple[list[Trajectory], int]:
        if not self.cfg.method.selection or store is None:
            return trajs, len(trajs)
        from hamo_ray.selection import coverage_select
        from hamo_ray.types import card_id

        ids = [card_id(t.id) for t in trajs]
        result = coverage_select(
            store.vectors(ids),
            k=self.cfg.selection.k,
            min_budget=self.cfg.selection.min_budget,
            batch_size=self.cfg.selection.batch_size,
        )
        logger.info("select: budget %d of %d (coverage curve %s)", result.budget, len(trajs), result.curve)
        return [trajs[i] for i in result.order], result.budget

    def _replay(self, stage: int, done: list[StageResult], n_anchors: int) -> list[Trajectory]:
        earlier = []
        for r in done:
            if r.stage > 0:
                chosen = set(r.anchors)
                earlier += [t for t in self.folder.load_trajectories(r.stage) or [] if t.id in chosen]
        n = min(len(earlier), round(self.cfg.replay.ratio * n_anchors))
        picked = random.Random(self.cfg.run.seed * 1000 + stage).sample(earlier, n) if n else []
        logger.info("replay: %d of %d earlier anchors", len(picked), len(earlier))
        return picked

    def _experience(self, batch: list[Trajectory], store, stage: int) -> dict:
        """Injected cards per training trajectory: retrieved from M_t, never the example's own card."""
        if not (self.cfg.method.conditioning and store is not None and batch):
            return {}
        from hamo_ray.types import card_id

        ids = [card_id(t.id) for t in batch]
        hits = store.search(
            store.vectors(ids), k=self.cfg.memory.top_k, exclude_ids=[{i} for i in ids], max_stage=stage
        )
        return {t.id: [c for c, _ in h] for t, h in zip(batch, hits, strict=True)}

    def _train(
        self, stage: int, batch: list[Trajectory], store, model_path: str, prev: Path | None, rel: str
    ):
        from transformers import AutoTokenizer

        from hamo_ray.training.examples import build_examples
        from hamo_ray.training.trainer import train_model

        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        examples = build_examples(
            batch, self._experience(batch, store, stage), tokenizer, cfg.prompt, cfg.train.max_seq_len
        )
        logger.info(
            "train: %d trajectories -> %d examples (init from %s)",
            len(batch),
            len(examples),
            prev or "fresh LoRA",
        )
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

    def _eto(self, stage, domain, trajs, model_path, bc_path, bc_name, base_url, bc_loss):
        """ETO: explore the stage's tasks with the BC adapter, then DPO on (expert, failure) pairs."""
        from transformers import AutoTokenizer

        from hamo_ray.training.dpo import build_pairs, encode_pairs, train_dpo

        cfg = self.cfg
        spec = PolicySpec(
            base_url=base_url,
            model=bc_name,
            temperature=cfg.rollout.temperature,
            max_tokens=cfg.rollout.max_tokens,
            timeout_s=cfg.rollout.request_timeout_s,
            seed=cfg.run.seed + 7919,
        )
        explored = self._pool(domain).run(
            [t.task for t in trajs], spec, desc=f"stage {stage} ETO exploration"
        )
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        pairs = encode_pairs(build_pairs(trajs, explored), tokenizer, cfg.prompt, cfg.train.max_seq_len)
        logger.info("eto: %d failure/success pairs from %d explored episodes", len(pairs), len(explored))
        if not pairs:
            return bc_path, bc_name, bc_loss
        rel = f"adapters/stage-{stage}"
        result = train_dpo(
            model_path,
            str(self.folder.path / bc_path),
            pairs,
            self.folder.path / rel,
            cfg.train,
            self.folder.path / "train",
            pad_id=tokenizer.pad_token_id,
            seed=cfg.run.seed + stage,
            name=f"stage-{stage}-dpo",
        )
        name = self.adapter_name(stage)
        self._publish(base_url, name, self.folder.path / rel)
        return rel, name, result["loss"]

    def _release(self, store, anchors: list[Trajectory]) -> None:
        """METHOD.md step 6: mark the cards of internalised high-quality anchors released (not deleted)."""
        from hamo_ray.memory.pipeline import release_internalised

        n = release_internalised(store, anchors, self.cfg.memory)
        logger.info("release: %d cards marked released", n)

    def _evaluate(
        self, stage: int, base_url: str, model: str | None, harness_url: str | None
    ) -> dict[str, float]:
        cfg = self.cfg
        scores = {}
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
        for domain, tasks in self.test_tasks.items():
            trajs = self._pool(domain).run(tasks, spec, desc=f"stage {stage} evaluation ({domain})")
            self.folder.save_episodes(stage, domain, trajs)
            failed = [t for t in trajs if t.error]
            if failed:
                logger.warning("evaluate: %d %s episodes failed: %s", len(failed), domain, failed[0].error)
            scores[domain] = sum(t.score for t in trajs) / len(trajs)
        return scores
