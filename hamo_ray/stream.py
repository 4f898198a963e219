"""The stream: the single controller that runs a whole continual-learning run, stage by stage.

For each stage t (docs/method.md, docs/architecture.md): collect expert trajectories -> distil
into cards (Ray Data -> LanceDB) -> coverage selection -> replay -> experience-conditioned LoRA
training (Ray Train) -> publish the adapter under a new name and prove it live -> evaluate every
domain's test set against the endpoint -> commit. What runs beside the stages (Ray, the Serve
apps, adapter publishing) belongs to ``hamo_ray.runtime``.

Protocols: ``within_domain`` (one domain's train variations split into sample-disjoint stages,
each covering every task type) and ``cross_domain`` (one stage per domain of ``protocol.order``).
Methods (``method.*``) switch parts of the same loop on and off; there is no second loop.

The constructor only validates (domains, task types, model path, run folder); the task lists,
Ray and the servers come in ``run``. This module and ``jobs/`` are the only places that wait on Ray
results. Usage::

    cfg = load_config("jobs/configs/tiny.yaml", ["train.epochs=1"])
    results = Stream(cfg).run()
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path

from hamo_ray.cluster import check_serve_port, start_ray
from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.memory.pipeline import internalised, release_internalised, training_experience
from hamo_ray.run_folder import PhaseClock, RunFolder
from hamo_ray.runtime import Endpoint, Services
from hamo_ray.steps import (
    EnvPools,
    distil,
    domain_tasks,
    evaluate,
    replay,
    resolve_backbone,
    select,
    split_stages,
    stage_seed,
    stage_tasks,
)
from hamo_ray.types import StageResult, TaskSpec, Trajectory

__all__ = ["Stream", "check_model_path", "split_stages"]

logger = logging.getLogger(__name__)


def check_model_path(path: str) -> None:
    """A local-looking model path must exist; a hub id (``org/name``) is left to ``from_pretrained``.

    A packaged model name or a ``*.gguf`` file gets the cheap check of ``hamo_ray.models`` (package
    installed, file there, GGUF magic); it is converted into an HF folder only when the run starts.

    Raises:
        ConfigError: a missing path, an unknown packaged name, a missing package or a non-GGUF file.
    """
    from hamo_ray.models import check_model_source

    if path == "embedded":
        return
    if check_model_source(path) is not None:  # a packaged model or a GGUF file (a bare unknown name raises)
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
        from hamo_ray.envs.sources import check_data_sources

        check_data_sources(cfg)  # every data source named by the config is there (nothing substituted)
        self.cfg = cfg
        check_model_path(cfg.model.path)
        p = cfg.protocol
        self.domains = {name: get_domain(name, cfg.env) for name in cfg.domains()}
        for name, domain in self.domains.items():
            domain.check_task_types(cfg.task_types(name))
        self.run_id = cfg.run.id or f"{config_name}-{cfg.method.name}-s{cfg.run.seed}"
        self.folder = RunFolder(Path(cfg.run.root) / self.run_id, cfg)
        self.stage_domains = list(p.order) if p.kind == "cross_domain" else [cfg.env.domain] * p.num_stages
        self._pool = EnvPools(cfg)  # called as self._pool(domain)
        self.services: Services | None = None  # set in run(): the Serve apps beside the stream
        self.endpoint: Endpoint | None = None
        self.model_path = ""
        self.tracker = None  # set in run(): per-stage and per-training-step scalars (hamo_ray.tracking)

    @cached_property
    def stage_tasks(self) -> list[list[TaskSpec]]:
        """Each stage's training tasks, made on first use (ALFWorld generates games here)."""
        return stage_tasks(self.cfg, self.domains)

    @cached_property
    def test_tasks(self) -> dict[str, list[TaskSpec]]:
        """Every domain's test tasks, evaluated after every stage."""
        return {name: domain_tasks(self.cfg, self.domains, name, "test") for name in self.domains}

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
        """Connect to Ray and return the backbone path, building the embedded one if needed."""
        start_ray(self.cfg.ray)
        try:
            return resolve_backbone(self.cfg, self.folder, self._pool)
        finally:
            self._pool.close()

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
        from hamo_ray.tracking import Tracker, stage_scalars

        start_ray(self.cfg.ray)
        if base_url is None:  # this run starts its own endpoint: refuse a taken port before any work
            check_serve_port(self.cfg)
        tracker = Tracker(self.folder.path, self.cfg.run.tracking, "stream", self.cfg.model_dump(mode="json"))
        self.tracker = tracker
        self.services = Services(
            self.cfg, self.folder, self.cfg.method.uses_memory, shared_url=base_url, run_id=self.run_id
        )
        try:
            self.model_path = resolve_backbone(self.cfg, self.folder, self._pool)
            self.endpoint = self.services.start(self.model_path)
            self.services.publish_committed()  # a resumed run serves its adapters under their names
            for stage in todo:
                result = self._stage(stage, done) if stage else self._initial_evaluation()
                done.append(result)
                self.folder.commit(result)  # 8. commit
                tracker.log(stage_scalars(result), step=stage)
                logger.info("stage %d committed: scores %s", stage, result.scores)
        finally:
            tracker.close()
            from hamo_ray.training.group import shutdown_group

            shutdown_group(self)  # the training workers kept across stages
            self._pool.close()
            self.services.stop()
        return done

    # -- one stage ----------------------------------------------------------------------------
    def _initial_evaluation(self) -> StageResult:
        logger.info("=== stage 0: evaluation before any stage ===")
        clock = PhaseClock()
        with clock("evaluate"):
            scores, stats = self._evaluate(0, None)
        return StageResult.initial(self.cfg.method.name, scores, clock.seconds, stats)

    def _stage(self, stage: int, done: list[StageResult]) -> StageResult:
        """Steps 1-7 of one stage (``run`` commits it: step 8)."""
        cfg, m, domain, clock = self.cfg, self.cfg.method, self.stage_domains[stage - 1], PhaseClock()
        logger.info("=== stage %d/%d (%s, %s) ===", stage, cfg.protocol.stages, domain, m.name)
        with clock("collect"):  # 1. expert trajectories of the stage's tasks
            trajs = self._collect(stage, domain)
        with clock("distil"):  # 2. cards into the memory
            store, distilled = distil(cfg, self.folder, stage, trajs, self.endpoint)
        with clock("select"):  # 3. anchors by retrieval coverage
            anchors, budget = select(cfg, trajs, store, stage)
        with clock("replay"):  # 4. earlier stages' anchors
            replayed = replay(cfg, self.folder, stage, done, len(anchors))
        adapter = name = loss = None
        released, release = [], {}  # step 6's card ids and figures (method.release)
        if m.train:
            tag = "-bc" if m.dpo else ""  # ETO: behavioural cloning first, DPO on top
            prev = next((self.folder.path / r.adapter for r in reversed(done) if r.adapter), None)
            with clock("train"):  # 5. one LoRA adapter, initialised from the previous one
                rel = f"adapters/stage-{stage}{tag}"
                adapter, loss = self._train(stage, anchors + replayed, store, self.model_path, prev, rel)
            with clock("publish"):  # 6. served under a new name, proven live
                name = self.services.adapter_name(stage, tag)
                self.services.publish(name, adapter)
            if m.dpo:
                with clock("dpo"):
                    adapter, name, loss = self._eto(stage, domain, trajs, adapter, name, loss)
            if m.release and store is not None:  # docs/method.md step 6
                with clock("release"):
                    released, release = self._release(stage, domain, anchors, store, name, done)
        with clock("evaluate"):  # 7. every domain's test set
            scores, stats = self._evaluate(stage, name)
        return StageResult(
            stage=stage, method=m.name, domain=domain, num_trajectories=len(trajs),
            num_cards=store.count() if store is not None else 0, budget=budget,
            anchors=[t.id for t in anchors], replay=[t.id for t in replayed], adapter=adapter,
            adapter_name=name, train_loss=loss, scores=scores, seconds=clock.seconds, evaluation=stats,
            release=release, released=released, distil=distilled,
        )  # fmt: skip

    def _collect(self, stage: int, domain: str) -> list[Trajectory]:
        cached = self.folder.load_trajectories(stage)
        if cached is not None:
            logger.info("collect: reusing %d trajectories of stage %d", len(cached), stage)
            return cached
        if self.cfg.env.expert_source == "file":  # imported AgentGym / ETO data (hamo_ray.envs.expert_data)
            from hamo_ray.envs.expert_data import stage_experts

            ok = stage_experts(self.cfg, stage)
            logger.info("collect: %d imported expert trajectories for stage %d (%s)", len(ok), stage, domain)
            self.folder.save_trajectories(stage, ok)
            return ok
        tasks = self.stage_tasks[stage - 1]
        got = self._pool(domain).run(tasks, None, desc=f"stage {stage} expert episodes ({domain})")
        ok = [t for t in got if t.error is None and t.actions and t.score > 0]
        cut = sum(not t.done and len(t.actions) >= self.cfg.env.max_turns for t in got if t.error is None)
        if cut:
            logger.warning(
                "collect: %d of %d expert plans were cut at env.max_turns=%d (evaluation stops there); "
                "%d of them still scored and are kept",
                cut, len(got), self.cfg.env.max_turns, sum(not t.done for t in ok),
            )  # fmt: skip
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

    def _train(
        self, stage: int, batch: list[Trajectory], store, model_path: str, prev: Path | None, rel: str
    ):
        """Experience-conditioned BC on the kept worker group; the injected cards never include the own card."""
        from transformers import AutoTokenizer

        from hamo_ray.training.examples import build_examples, example_options
        from hamo_ray.training.group import group_for
        from hamo_ray.training.trainer import train_model

        cfg = self.cfg
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        conditioned = cfg.method.conditioning and store is not None
        cards = training_experience(store, batch, cfg.memory.top_k, max_stage=stage) if conditioned else {}
        examples = build_examples(
            batch, cards, tokenizer, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
            **example_options(cfg),
        )  # fmt: skip
        logger.info(
            "train: %d trajectories -> %d %s examples, %d tokens (init from %s)", len(batch), len(examples),
            cfg.train.example_format, sum(len(e.input_ids) for e in examples), prev,
        )  # fmt: skip
        result = train_model(
            model_path, examples, self.folder.path / rel, cfg.train, self.folder.path / "train",
            pad_id=tokenizer.pad_token_id, init_adapter=str(prev) if prev else None, seed=stage_seed(cfg.run.seed, stage, "train"),
            name=f"stage-{stage}", group=group_for(self, cfg.train),
        )  # fmt: skip
        self.tracker.log_steps(result.step_metrics, "train")  # numbered on from earlier stages
        logger.info(
            "train: losses %s, %d tokens in %.0fs (+%.1fs start-up)",
            [round(x, 3) for x in result.losses], result.tokens, result.seconds, result.startup_s,
        )  # fmt: skip
        return rel, result.loss

    def _eto(self, stage, domain, trajs, bc_path, bc_name, bc_loss):
        """ETO: explore the stage's tasks with the BC adapter, then DPO on (expert, failure) pairs."""
        from transformers import AutoTokenizer

        from hamo_ray.training.dpo import build_pairs, encode_pairs, train_dpo
        from hamo_ray.training.examples import example_options
        from hamo_ray.training.group import group_for

        cfg, model_path = self.cfg, self.model_path
        spec = self.endpoint.spec(bc_name, cfg, seed=stage_seed(cfg.run.seed, stage, "explore"))
        explored = self._pool(domain).run(
            [t.task for t in trajs], spec, desc=f"stage {stage} ETO exploration"
        )
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        pairs = build_pairs(trajs, explored)
        encoded = encode_pairs(
            pairs, tokenizer, cfg.prompt, cfg.train.max_seq_len, cfg.model.template_kwargs(),
            **example_options(cfg),
        )  # fmt: skip
        logger.info("eto: %d failure/success pairs from %d explored episodes", len(encoded), len(explored))
        if not encoded:
            return bc_path, bc_name, bc_loss
        rel = f"adapters/stage-{stage}"
        result = train_dpo(
            model_path, str(self.folder.path / bc_path), encoded, self.folder.path / rel, cfg.train,
            self.folder.path / "train", pad_id=tokenizer.pad_token_id, seed=stage_seed(cfg.run.seed, stage, "dpo"),
            name=f"stage-{stage}-dpo", group=group_for(self, cfg.train),
        )  # fmt: skip
        self.tracker.log_steps(result.step_metrics, "dpo")
        name = self.services.adapter_name(stage)
        self.services.publish(name, rel)
        return rel, name, result.loss

    def _release(
        self, stage: int, domain: str, anchors: list[Trajectory], store, adapter_name: str, done: list
    ) -> tuple[list[str], dict[str, float]]:
        """Step 6: release the cards of the anchors the new adapter solves without any card.

        The anchors' tasks are replayed by ``adapter_name`` (the stage's final adapter: for ETO the DPO
        one) with retrieval off, so no card at all is injected, not only the anchor's own (the simplest
        faithful reading of "internalised"); a card goes when its replay reached
        ``memory.release_min_score`` without error (``release_internalised``). In the same rollout the
        tasks of the cards the previous stage released are replayed again, the same way: how many are
        still solved says whether a released card's task stays solved one stage later (measured only,
        nothing is un-released). One seed, ``stage_seed(run.seed, stage, "release")``, for both.

        Returns:
            The card ids released, and the figures for ``StageResult.release``: ``replayed``,
            ``released``, ``replay_failed`` (replays with an error), ``replay_mean_score`` (over the
            replays without error), ``followup_checked``, ``followup_solved``.
        """
        cfg = self.cfg
        prev = next((r for r in done if r.stage == stage - 1), None)
        followup: list[Trajectory] = []
        if prev is not None and prev.released:
            wanted = set(prev.released)
            followup = [t for t in self.folder.load_trajectories(prev.stage) or [] if t.card_id in wanted]
            if len(followup) < len(wanted):
                logger.warning(
                    "release: %d of stage %d's %d released cards have no stored trajectory; not followed up",
                    len(wanted) - len(followup), prev.stage, len(wanted),
                )  # fmt: skip
        spec = self.endpoint.spec(
            adapter_name, cfg, seed=stage_seed(cfg.run.seed, stage, "release"), retrieval=False
        )
        tasks = [t.task for t in anchors] + [t.task for t in followup]
        by_domain: dict[str, list[int]] = {}  # one rollout per domain (cross-domain follow-ups differ)
        for i, task in enumerate(tasks):
            by_domain.setdefault(task.domain, []).append(i)
        episodes: list[Trajectory | None] = [None] * len(tasks)
        for d, idx in by_domain.items():
            got = self._pool(d).run([tasks[i] for i in idx], spec, desc=f"stage {stage} release replay ({d})")
            for i, t in zip(idx, got, strict=True):
                episodes[i] = t
        replays, again = episodes[: len(anchors)], episodes[len(anchors) :]
        ids = release_internalised(store, anchors, replays, cfg.memory)
        ran = [t.score for t in replays if t.error is None]
        figures = {
            "replayed": float(len(replays)),
            "released": float(len(ids)),
            "replay_failed": float(len(replays) - len(ran)),
            "replay_mean_score": sum(ran) / len(ran) if ran else 0.0,
            "followup_checked": float(len(again)),
            "followup_solved": float(sum(internalised(t, cfg.memory) for t in again)),
        }
        logger.info(
            "release: stage %d (%s): %d of %d anchors solved without cards (mean %.1f, %d failed) -> "
            "cards released; follow-up: %d of the %d released at stage %d still solved",
            stage, domain, len(ids), len(replays), figures["replay_mean_score"], len(replays) - len(ran),
            int(figures["followup_solved"]), len(again), stage - 1,
        )  # fmt: skip
        return ids, figures

    def _evaluate(self, stage: int, model: str | None) -> tuple[dict[str, float], dict[str, float]]:
        cfg = self.cfg
        spec = self.endpoint.spec(
            model or cfg.model.name,
            cfg,
            seed=stage_seed(cfg.run.seed, stage, "evaluate"),
            retrieval=cfg.method.retrieval,
        )
        return evaluate(self._pool, self.folder, stage, self.test_tasks, spec)
