"""What serving a finished (or running) run folder needs: its base model and its ``Services``.

``run_model_path`` finds the model a run's adapters were trained on, whichever way the run named it;
``run_services`` builds the ``Services`` that serve the run (with its harness when it has a memory).
``jobs/serve.py`` is the command line over these.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hamo_ray.config import ConfigError, HamoConfig

logger = logging.getLogger(__name__)


def run_model_path(cfg: HamoConfig, run: Path) -> str:
    """The base model folder of ``run``: ``model.path``, else the embedded backbone's cache folder.

    A GGUF file or a packaged model is the HF folder it was converted into (``hamo_ray.backbones.sources``;
    converted now if the cache lost it). For the embedded backbone, in this order: the folder the
    stream recorded in ``state.json``; the cache folder named by a hash of the settings
    (``backbone_path``); when code changes moved that name, the folder the run's adapters were trained
    on (peft's ``base_model_name_or_path``).

    Raises:
        ConfigError: the embedded backbone is in none of these places.
    """
    if cfg.model.path != "embedded":
        from hamo_ray.backbones.sources import resolve_model_path

        return resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    from hamo_ray.backbones.toy import backbone_path

    recorded = _recorded_backbone(run)
    if recorded is not None:
        return recorded  # the stream records the backbone it resolved
    path = backbone_path(cfg)
    if (path / "config.json").is_file():
        return str(path)
    for adapter_config in sorted((run / "adapters").glob("*/adapter_config.json")):
        base = Path(json.loads(adapter_config.read_text()).get("base_model_name_or_path") or "/nonexistent")
        if (base / "config.json").is_file():
            logger.warning("backbone not at %s; using %s, the base of %s", path, base, adapter_config.parent)
            return str(base)
    raise ConfigError(f"the run's embedded backbone is not built at {path} (run the stream first)")


def _recorded_backbone(run: Path) -> str | None:
    """The backbone folder ``state.json`` records, if it still holds a model."""
    state = run / "state.json"
    recorded = json.loads(state.read_text()).get("backbone") if state.is_file() else None
    return recorded if recorded and (Path(recorded) / "config.json").is_file() else None


def run_services(run: Path, cfg: HamoConfig, max_stage: int | None):
    """The ``Services`` that serve ``run`` (stages 1..``max_stage``; all when None): with the harness
    when the run has a memory."""
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.run.services import Services

    folder = RunFolder(run, cfg)
    has_memory = Path(folder.memory_uri).exists() or "://" in folder.memory_uri
    if not has_memory:
        logger.warning("no memory at %s: serving without the harness", folder.memory_uri)
    return Services(cfg, folder, harness=has_memory, max_stage=max_stage)
