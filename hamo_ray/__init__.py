"""hamo-ray: HaMo (Harness-Model collaboration for long-horizon continual learning) on Ray.

Importing the package is light: torch, vllm, deepspeed and Ray load only where they are used.
The layout by role is docs/architecture.md; a module that moved in that layout is refused by its old
name with a message naming the new place (``MOVED``).
"""

import importlib.abc
import sys

__version__ = "0.1.0"

# Old module -> where it lives now (the packages by role: run/, sweep/, backbones/).
MOVED = {
    "hamo_ray.stream": "hamo_ray.run.stream",
    "hamo_ray.stage": "hamo_ray.run.stage (the acting steps: hamo_ray.run.acting)",
    "hamo_ray.steps": "hamo_ray.run.resources",
    "hamo_ray.runtime": "hamo_ray.run.services (Serve apps: hamo_ray.run.serve_apps)",
    "hamo_ray.run_folder": "hamo_ray.run.folder",
    "hamo_ray.cluster": "hamo_ray.run.cluster",
    "hamo_ray.dryrun": "hamo_ray.run.dryrun",
    "hamo_ray.gpu_plan": "hamo_ray.run.gpu_plan",
    "hamo_ray.serve_run": "hamo_ray.run.serve_job",
    "hamo_ray.tracking": "hamo_ray.run.tracking",
    "hamo_ray.sweep_export": "hamo_ray.sweep.export",
    "hamo_ray.sweep_grid": "hamo_ray.sweep.grid",
    "hamo_ray.sweep_report": "hamo_ray.sweep.report",
    "hamo_ray.sweep_runner": "hamo_ray.sweep.runner",
    "hamo_ray.sweep_stats": "hamo_ray.sweep.stats",
    "hamo_ray.models": "hamo_ray.backbones.sources",
    "hamo_ray.gguf_convert": "hamo_ray.backbones.gguf",
    "hamo_ray.training.tiny_lm": "hamo_ray.backbones.tiny_lm",
    "hamo_ray.training.backbone": "hamo_ray.backbones.toy",
}


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Last on ``sys.meta_path``: consulted only for a name no file answers; names a moved module's new place."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED:
            raise ModuleNotFoundError(f"{name} has moved: import {MOVED[name]} instead", name=name)
        return None


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
