"""The policy endpoint's ``GET /metrics``: every replica's metrics in one answer, and a peak gauge.

vLLM's own ``/metrics`` is one process's. Here each replica publishes its Prometheus page every
``PUBLISH_EVERY_S`` to a small named actor (the app's board), and ``/metrics`` on any replica answers
with all of them, every sample labelled ``replica``, so a scraper behind Serve's proxy sees the whole
deployment (``sum without (replica) (...)`` gives its totals). ``RunningPeak`` adds
``hamo:num_requests_running_peak``: the highest ``vllm:num_requests_running`` seen while requests were
in flight, readable after a burst, when polls during it would have queued behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

RUNNING, RUNNING_PEAK = "vllm:num_requests_running", "hamo:num_requests_running_peak"
REPLICA_LABEL = "replica"
PUBLISH_EVERY_S = 5.0  # each replica publishes its metrics this often
STALE_AFTER_S = 30.0  # a replica silent this long is left out (it died or stopped)


class RunningPeak:
    """Samples vLLM's running-requests gauge every ``interval_s`` while POST requests are in flight."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s, self.inflight, self.peak = interval_s, 0, 0.0
        self._task: asyncio.Task | None = None

    def enter(self) -> None:
        self.inflight += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def exit(self) -> None:
        self.inflight -= 1

    async def _watch(self) -> None:
        from prometheus_client import REGISTRY

        while self.inflight:  # then idle until the next request
            await asyncio.sleep(self.interval_s)
            collector = getattr(REGISTRY, "_names_to_collectors", {}).get(RUNNING)
            if collector is not None:
                values = [s.value for m in collector.collect() for s in m.samples if s.name == RUNNING]
                self.peak = max([self.peak, *values])

    def text(self, model: str) -> str:
        return (
            f"# HELP {RUNNING_PEAK} Highest {RUNNING} seen while requests were in flight.\n"
            f'# TYPE {RUNNING_PEAK} gauge\n{RUNNING_PEAK}{{model_name="{model}"}} {self.peak}\n'
        )


class InflightMiddleware:
    """ASGI middleware counting POST requests as in flight for ``RunningPeak`` until their response ends."""

    def __init__(self, app, peak: RunningPeak) -> None:
        self.app, self.peak = app, peak

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.peak.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.peak.exit()


def metrics_board(name: str):
    """The named board actor of one app, made by the first replica that asks and owned by it (not
    detached): if that replica goes, the next publisher makes a new one, refilled within a period."""
    import ray

    @ray.remote(num_cpus=0)
    class MetricsBoard:
        def __init__(self) -> None:
            self._texts: dict[str, tuple[float, str]] = {}

        def publish(self, replica: str, text: str) -> None:
            self._texts[replica] = (time.time(), text)

        def texts(self, max_age_s: float) -> dict[str, str]:
            return {r: text for r, (t, text) in self._texts.items() if time.time() - t <= max_age_s}

    return MetricsBoard.options(name=name, namespace="hamo-metrics", get_if_exists=True).remote()


def merge_replicas(texts: dict[str, str]) -> str:
    """One exposition text out of replica id -> text: each family once, every sample labelled ``replica``."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica in sorted(texts):
        for family in text_string_to_metric_families(texts[replica]):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                labels = {**s.labels, REPLICA_LABEL: replica}
                merged.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry).decode()


class ReplicaMetrics:
    """One replica's side of the board: publish ``own()`` (this replica's text), answer with everyone's."""

    def __init__(self, own: Callable[[], str]):
        self._own, self._replica, self._board, self._task = own, "local", None, None

    def start(self) -> None:
        """Start publishing (from the replica's event loop; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        from ray import serve

        try:
            ctx = serve.get_replica_context()
            self._replica, app = ctx.replica_id.unique_id, ctx.replica_id.deployment_id.app_name
        except Exception:  # not inside Serve (a unit test): /metrics is this process's alone
            return
        while True:
            try:
                self._board = self._board or metrics_board(f"policy-metrics-{app}")
                await self._board.publish.remote(self._replica, self._own())
            except Exception:  # the board's owner replica went away: make (or find) a new one
                logger.debug("metrics board unreachable", exc_info=True)
                self._board = None
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def text(self) -> str:
        """This replica's metrics read now, the others' as last published (only ours before the board)."""
        self.start()
        own = self._own()
        texts = {self._replica: own}
        if self._board is not None:
            try:
                await self._board.publish.remote(self._replica, own)
                texts = {**await self._board.texts.remote(STALE_AFTER_S), self._replica: own}
            except Exception:
                logger.debug("metrics board unreachable", exc_info=True)
        return merge_replicas(texts)
