"""The policy endpoint's ``GET /metrics``: every replica's metrics in one answer, and a peak gauge.

- ``RunningPeak``: the peak of vLLM's running-requests gauge, appended to the engine's metrics.
- ``ReplicaMetrics``: each replica publishes its metrics every ``PUBLISH_EVERY_S`` to a small named
  actor (the app's board); ``/metrics`` on any replica answers with all of them, every sample
  labelled ``replica``, so a scraper behind Serve's proxy sees the whole deployment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

logger = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
RUNNING_PEAK = "hamo:num_requests_running_peak"


class RunningPeak:
    """The highest value of vLLM's running-requests gauge seen since the replica started.

    While requests are in flight, a background task reads the gauge from this process's Prometheus
    registry every ``interval_s``. ``/metrics`` reports the peak (``hamo:num_requests_running_peak``),
    so a client that polls after a burst still sees how many requests the engine ran together;
    polls during the burst would queue behind it.
    """

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.inflight = 0
        self.peak = 0.0
        self._task: asyncio.Task | None = None

    def enter(self) -> None:
        self.inflight += 1
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def exit(self) -> None:
        self.inflight -= 1

    async def track(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """``events`` (a streamed response), counted as one request in flight until it ends."""
        self.enter()
        try:
            async for event in events:
                yield event
        finally:
            self.exit()

    @staticmethod
    def current() -> float | None:
        """vLLM's running-requests gauge in this process (None where it is not registered)."""
        from prometheus_client import REGISTRY

        collector = getattr(REGISTRY, "_names_to_collectors", {}).get(RUNNING)
        if collector is None:
            return None
        values = [s.value for metric in collector.collect() for s in metric.samples if s.name == RUNNING]
        return max(values) if values else None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.inflight:
                try:
                    value = self.current()
                except Exception:  # another prometheus_client or vLLM layout: no peak, no harm
                    logger.debug("cannot read %s", RUNNING, exc_info=True)
                    return
                if value is not None:
                    self.peak = max(self.peak, value)

    def text(self, model: str) -> str:
        """The peak as Prometheus exposition text."""
        return (
            f"# HELP {RUNNING_PEAK} Highest {RUNNING} seen while requests were in flight.\n"
            f"# TYPE {RUNNING_PEAK} gauge\n"
            f'{RUNNING_PEAK}{{model_name="{model}"}} {self.peak}\n'
        )


# -- one /metrics for every replica ----------------------------------------------------------------
REPLICA_LABEL = "replica"
PUBLISH_EVERY_S = 5.0  # each replica publishes its metrics this often
STALE_AFTER_S = 30.0  # a replica that has not published for this long is left out (it died or stopped)


def _board_class():
    import ray

    @ray.remote(num_cpus=0)
    class MetricsBoard:
        """The latest Prometheus text of each replica of one deployment, keyed by replica id."""

        def __init__(self) -> None:
            self._texts: dict[str, tuple[float, str]] = {}

        def publish(self, replica: str, text: str) -> None:
            import time

            self._texts[replica] = (time.time(), text)

        def drop(self, replica: str) -> None:
            self._texts.pop(replica, None)

        def texts(self, max_age_s: float) -> dict[str, str]:
            import time

            now = time.time()
            return {r: text for r, (t, text) in self._texts.items() if now - t <= max_age_s}

    return MetricsBoard


def metrics_board(name: str):
    """The named board actor of one policy app: made by the first replica that asks, found by the others.

    It is owned by the replica that made it (no detached actor to leak): if that replica goes, the
    board goes with it and the next publisher makes a new one, which every live replica refills
    within ``PUBLISH_EVERY_S``.
    """
    return _board_class().options(name=name, namespace="hamo-metrics", get_if_exists=True).remote()


def merge_replicas(texts: dict[str, str]) -> str:
    """One exposition text out of several replicas': every sample gains a ``replica`` label.

    Families with the same name (every replica exports the same vLLM metrics) are written once, with
    the samples of all replicas, so a scraper reading ``/metrics`` through any replica sees them all;
    ``sum without (replica) (...)`` in PromQL gives the deployment's totals.

    Args:
        texts: replica id -> that replica's Prometheus exposition text.

    Returns:
        The merged exposition text (Prometheus text format 0.0.4).
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.samples import Sample

    families: dict[str, Metric] = {}
    for replica in sorted(texts):
        for family in text_string_to_metric_families(texts[replica]):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type)
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
    """One replica's side of the board: publish this replica's text, answer with every replica's.

    Args:
        own: returns this replica's Prometheus exposition text.
    """

    def __init__(self, own: Callable[[], str]):
        self._own = own
        self._replica, self._board, self._task = "local", None, None

    def start(self) -> None:
        """Start publishing (call from the replica's event loop; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._publish())

    async def _publish(self) -> None:
        from ray import serve

        try:
            ctx = serve.get_replica_context()
            self._replica = ctx.replica_id.unique_id
            app = ctx.replica_id.deployment_id.app_name
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
        """Every replica's metrics: this one's read now, the others' as last published.

        Before the board exists (the replica's first seconds) only this replica's.
        """
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
