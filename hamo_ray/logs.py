"""Logging setup shared by the jobs, the Ray actors and the training workers."""

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
