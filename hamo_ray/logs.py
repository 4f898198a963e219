"""Logging and progress reporting shared by the jobs, the Ray actors and the training workers.

Long phases (episodes, training steps, card writing, selection) report progress in one of two ways:
on a terminal, a ``tqdm`` bar with counts, rate and ETA; elsewhere (``ray job submit`` logs, CI, the
Ray actors, whose output is never a terminal) a compact log line every tenth of the phase and at
least once a minute, so job logs stay readable::

    progress = Progress(total=200, desc="stage-1 train", unit="step", log=logger)
    for ...:
        progress.update(1, figures=lambda: {"loss": 1.23, "tok/s": 4100})   # called only when shown
    progress.close()
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from typing import Any

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | int | None = None) -> None:
    """Configure the root logger once per process (level from HAMO_LOG_LEVEL, default INFO)."""
    level = level or os.environ.get("HAMO_LOG_LEVEL", "INFO")
    root = logging.getLogger()
    if not any(getattr(h, "_hamo", False) for h in root.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
        handler._hamo = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    logging.getLogger("hamo_ray").setLevel(level)
    root.setLevel(logging.WARNING)


# Ray Train's placement-group cleaner asks Ray's state API (served by the dashboard) every second
# whether the Train controller is alive; a private local Ray runs no dashboard, so every check fails
# with this warning, ~3,600 lines an hour for as long as a stream keeps its training run.
REPEATED_WARNINGS = {
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": (
        "Failed to query Ray Train Controller actor state",
        "this Ray runs no dashboard, so its state API never answers: repeats of this warning are hidden",
    ),
}


class FirstOnly(logging.Filter):
    """Let the first record starting with ``prefix`` through, with ``note`` appended; drop the rest."""

    def __init__(self, prefix: str, note: str) -> None:
        super().__init__()
        self.prefix, self.note, self.seen = prefix, note, False

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        if self.seen:
            return False
        self.seen = True
        record.msg, record.args = f"{message} ({self.note})", ()
        return True


def ray_worker_setup() -> None:
    """Ray's ``worker_process_setup_hook`` of the private local Ray (``cluster.start_ray``).

    Runs in every worker process before its task or actor: shows each warning of
    :data:`REPEATED_WARNINGS` once. Standard library only, so every worker can import it cheaply.
    """
    for name, (prefix, note) in REPEATED_WARNINGS.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, FirstOnly) for f in log.filters):
            log.addFilter(FirstOnly(prefix, note))


def progress_bar(total: int, desc: str, unit: str = "it"):
    """A ``tqdm`` bar on a terminal, a silent one elsewhere (``bar.disable`` tells which)."""
    import sys

    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        dynamic_ncols=True,
        leave=False,
        disable=not sys.stderr.isatty(),
    )


def format_duration(seconds: float) -> str:
    """``75`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


class Progress:
    """A phase's progress: a ``tqdm`` bar on a terminal, else a log line per tenth of the phase.

    Args:
        total: the units the phase will do.
        desc: the phase's name, first in every line.
        unit: what one unit is (``step``, ``card``, ``block``).
        log: the logger of the lines (off a terminal); None logs nothing but the bar.
        lines: about how many lines a whole phase logs off a terminal.
        min_interval_s: a line is logged at least this often while units complete.
        enabled: False shows and logs nothing (e.g. on all but rank 0).
        bar: False logs lines even on a terminal (where another bar, e.g. Ray Data's, already shows).
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "it",
        log: logging.Logger | None = None,
        lines: int = 10,
        min_interval_s: float = 60.0,
        enabled: bool = True,
        bar: bool = True,
    ) -> None:
        self.total, self.desc, self.unit, self.log = max(0, total), desc, unit, log
        self.enabled = enabled
        self.bar = progress_bar(self.total, desc, unit) if enabled and bar else None
        self.every = max(1, math.ceil(self.total / max(1, lines)))
        self.min_interval_s = min_interval_s
        self.n = 0
        self._next_line = self.every  # the count at which the next line is due
        self.start = self._last_line = self._last_postfix = time.perf_counter()
        self.last_figures: dict[str, Any] = {}

    @property
    def on_terminal(self) -> bool:
        return self.bar is not None and not self.bar.disable

    def update(
        self, n: int = 1, figures: Callable[[], dict[str, Any]] | dict[str, Any] | None = None
    ) -> None:
        """Count ``n`` more units; ``figures`` (or a function giving them) are shown with the count.

        A function is called only when its figures are shown (about once a second on a terminal,
        with each log line elsewhere), so figures that cost a device synchronisation stay cheap.
        """
        if not self.enabled:
            return
        self.n += n
        now = time.perf_counter()
        last = self.n >= self.total
        if self.on_terminal:
            self.bar.update(n)
            if figures is not None and (now - self._last_postfix >= 1.0 or last):
                self._last_postfix = now
                self.last_figures = figures() if callable(figures) else figures
                self.bar.set_postfix({k: _figure(v) for k, v in self.last_figures.items()}, refresh=False)
            return
        due = self.n >= self._next_line or last or now - self._last_line >= self.min_interval_s
        if not due or self.log is None:
            return
        self._last_line, self._next_line = now, (self.n // self.every + 1) * self.every
        if figures is not None:
            self.last_figures = figures() if callable(figures) else figures
        self.log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """``"<desc>: 40/200 steps (20%), 3.1 step/s, ETA 0:52, loss 1.23"``."""
        elapsed = (now or time.perf_counter()) - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else math.inf
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        text = f"{self.desc}: {self.n}/{self.total} {self.unit}s{share}, {rate:.3g} {self.unit}/s"
        if self.n < self.total:
            text += f", ETA {format_duration(eta)}"
        else:
            text += f", in {format_duration(elapsed)}"
        return text + "".join(f", {k} {_figure(v)}" for k, v in self.last_figures.items())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
