"""The stream: the single controller that runs a whole continual-learning run, stage by stage.

For each stage t (docs/method.md, docs/architecture.md): collect expert trajectories -> distil
into cards (Ray Data -> LanceDB) -> coverage selection -> replay -> experience-conditioned LoRA
training (on the stream's kept Ray worker group, ``training.group``) -> publish the adapter under
a new name and prove it live -> evaluate every domain's test set against the endpoint -> commit.
The steps of a stage are ``hamo_ray.run.stage`` (``run_stage``); this module keeps the loop over the
stages, the resume and the commit. What runs beside the stages (Ray, the Serve apps, adapter
publishing) belongs to ``hamo_ray.run.services``.

Protocols: ``within_domain`` (one domain's train variations split into sample-disjoint stages,
each covering every task type) and ``cross_domain`` (one stage per domain of ``protocol.order``).
Methods (``method.*``) switch parts of the same loop on and off; there is no second loop.

The constructor only validates (domains, task types, model path, run folder); the task lists,
Ray, the servers and the training workers come in ``run``. Ray work is started from the stream
(and from ``jobs/``) only; it blocks inside the handles that own that work (``EnvPool.run``: rollout
actors, ``training.actors.TrainerGroup``: training actors, the card pipeline of ``memory.pipeline``: Ray Data,
``Services``: the Serve apps), never in a stage step itself. Usage::

    cfg = load_config("jobs/configs/tiny.yaml", ["train.epochs=1"])
    results = Stream(cfg).run()
"""

from __future__ import annotations

import logging
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig
from hamo_ray.run.cluster import check_serve_port, start_ray
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.resources import EnvPools, TaskLists, resolve_backbone, split_stages
from hamo_ray.run.services import Endpoint, Services
from hamo_ray.run.stage import StageContext, initial_stage, run_stage
from hamo_ray.training.group import KeptGroup
from hamo_ray.types import StageResult, TaskSpec

__all__ = ["Stream", "check_model_path", "split_stages"]

logger = logging.getLogger(__name__)


def check_model_path(path: str) -> None:
    """A local-looking model path must exist; a hub id (``org/name``) is left to ``from_pretrained``.

    A packaged model name or a ``*.gguf`` file gets the cheap check of ``hamo_ray.backbones.sources`` (package
    installed, file there, GGUF magic); it is converted into an HF folder only when the run starts.

    Raises:
        ConfigError: a missing path, an unknown packaged name, a missing package or a non-GGUF file.
    """
    from hamo_ray.backbones.sources import check_model_source

    if path == "embedded":
        return
    if check_model_source(path) is not None:  # a packaged model or a GGUF file (a bare unknown name raises)
        return
    looks_local = path.startswith(("/", ".", "~")) or Path(path).expanduser().exists() or path.count("/") != 1
    if looks_local and not Path(path).expanduser().exists():
        raise ConfigError(
            f"model.path: {path!r} does not exist (use an existing HF folder, a hub id, or 'embedded')"
        )


def check_action_constraint(cfg: HamoConfig, domains: dict) -> list[str]:
    """With ``rollout.constrain_actions``, the run's domains whose replies stay free (they do not list
    their actions cheaply: ScienceWorld); logged. No constraint at all is an error, not a silent no-op.

    Raises:
        ConfigError: ``rollout.constrain_actions`` on a run none of whose domains lists its actions.
    """
    if not cfg.rollout.constrain_actions:
        return []
    free = [name for name, domain in domains.items() if not domain.lists_actions]
    if len(free) == len(domains):
        raise ConfigError(
            f"rollout.constrain_actions: none of this run's domains ({', '.join(free)}) lists its admissible "
            "actions cheaply (alfworld, webshop and textworld do); set it to false"
        )
    if free:
        logger.info(
            "rollout.constrain_actions: replies stay free in %s (no cheap action list)", ", ".join(free)
        )
    return free


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
        check_action_constraint(cfg, self.domains)
        self.run_id = cfg.run.id or f"{config_name}-{cfg.method.name}-s{cfg.run.seed}"
        self.folder = RunFolder(Path(cfg.run.root) / self.run_id, cfg)
        self.stage_domains = list(p.order) if p.kind == "cross_domain" else [cfg.env.domain] * p.num_stages
        self.tasks = TaskLists(cfg, self.domains)  # made on first use
        self._pool = EnvPools(cfg)  # called as self._pool(domain)
        self.services: Services | None = None  # set in run(): the Serve apps beside the stream
        self.endpoint: Endpoint | None = None
        self.model_path = ""
        self.tracker = None  # set in run(): per-stage and per-training-step scalars (hamo_ray.run.tracking)
        # set in run(), closed when it ends: the training workers kept across stages (started on first use)
        self.train_group: KeptGroup | None = None

    @property
    def stage_tasks(self) -> list[list[TaskSpec]]:
        """Each stage's training tasks, made on first use (ALFWorld generates games here)."""
        return self.tasks.stages

    @property
    def test_tasks(self) -> dict[str, list[TaskSpec]]:
        """Every domain's test tasks, evaluated after every stage."""
        return self.tasks.test

    # -- the whole run -------------------------------------------------------------------------
    @property
    def expected_stages(self) -> list[int]:
        first = 0 if self.cfg.protocol.eval_initial else 1
        return list(range(first, self.cfg.protocol.stages + 1))

    @property
    def finished(self) -> bool:
        """Whether the run folder already holds every stage of this run."""
        return {r.stage for r in self.folder.stages()} >= set(self.expected_stages)

    def _undo_uncommitted(self, done: list[StageResult]) -> None:
        """What a killed attempt at the next stage changed beyond its files is undone before it is redone:
        card releases (``method.release``). Its cards stay: a redo distils the same stored trajectories
        into the same card ids, and the memory skips ids it holds."""
        if not (self.cfg.method.uses_memory and self.cfg.method.release):
            return
        self.folder.store(self.cfg).restore_releases({i for r in done for i in r.released})

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
        self.folder.lock()  # one job per run folder; released when this job ends (or is killed)
        try:
            return self._run(base_url)
        finally:
            self.folder.unlock()

    def _run(self, base_url: str | None) -> list[StageResult]:
        done = self.folder.prepare()
        todo = [s for s in self.expected_stages if s not in {r.stage for r in done}]
        if not todo:
            logger.info("run %s already holds all its stages; nothing to do", self.folder.path)
            return done
        self._undo_uncommitted(done)
        from hamo_ray.run.tracking import Tracker, stage_scalars
        from hamo_ray.training.driver import StageTrainer

        start_ray(self.cfg.ray)
        if base_url is None:  # this run starts its own endpoint: refuse a taken port before any work
            check_serve_port(self.cfg)
        tracker = Tracker(self.folder.path, self.cfg.run.tracking, "stream", self.cfg.model_dump(mode="json"))
        self.tracker = tracker
        self.services = Services(
            self.cfg, self.folder, self.cfg.method.uses_memory, shared_url=base_url, run_id=self.run_id
        )
        storage = self.cfg.train.storage or self.folder.path / "ray_train"
        self.train_group = KeptGroup(self.cfg.train, storage=storage)
        try:
            self.model_path = resolve_backbone(self.cfg, self.folder, self._pool)
            self.endpoint = self.services.start(self.model_path)
            self.services.publish_committed()  # a resumed run serves its adapters under their names
            ctx = StageContext(
                cfg=self.cfg, folder=self.folder, pools=self._pool, endpoint=self.endpoint,
                services=self.services, trainer=StageTrainer(self.cfg, self.model_path, self.train_group),
                tracker=tracker, tasks=self.tasks,
            )  # fmt: skip
            for stage in todo:  # steps 1-7 (hamo_ray.run.stage), then the commit
                if stage == 0:
                    result = initial_stage(ctx)
                else:
                    result = run_stage(ctx, stage, self.stage_domains[stage - 1], done)
                done.append(result)
                self.folder.commit(result)  # 8. commit
                tracker.log(stage_scalars(result), step=stage)
                logger.info("stage %d committed: scores %s", stage, result.scores)
        finally:
            tracker.close()
            self.train_group.close()  # the training workers kept across stages
            self._pool.close()
            self.services.stop()
        return done
