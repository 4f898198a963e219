"""Logging and progress bars shared by the jobs, the Ray actors and the training workers.

Long phases (episodes, training steps, distillation) show a ``tqdm`` bar with counts, rate and ETA when
the driver writes to a terminal; without one (``ray job submit`` logs, CI) the bar stays silent and the
phase logs one line when it ends, so job logs stay readable.
"""

from __future__ import annotations

import logging
import os

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
