"""A sweep file and its grid: ``SweepConfig``, ``load_sweep`` and one config per cell (``expand_cells``).

The file format is described in ``hamo_ray/sweep.py``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hamo_ray.config import ConfigError, HamoConfig, load_config


class GridConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    method: list[str] = Field(default_factory=lambda: ["hamo"])
    model: list[str] = Field(default_factory=lambda: ["embedded"])
    order: list[list[str]] = Field(default_factory=list)  # empty: the base config's own protocol
    seed: list[int] = Field(default_factory=lambda: [0])
    vary: dict[str, list[Any]] = Field(default_factory=dict)  # any dotted key of HamoConfig -> its values


class SweepConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str
    overrides: list[str] = Field(default_factory=list)
    root: str = "runs/sweep"
    results: str | None = None  # a tracked folder the cells' small results are exported to (see above)
    parallel: int = Field(default=1, ge=1)
    cell_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 0})
    share_experts: bool = True  # cells on the same tasks: the same expert trajectories (<root>/experts)
    share_initial: bool = True  # cells whose stage 0 is the same evaluate it once (<root>/initial)
    run_order: Literal["grid", "seed"] = "grid"  # seed: every cell of a seed before the next seed's
    # where the shared caches are kept (hamo_ray/sweep/shared.py); None: <results>/shared. Two sweeps over
    # one root (e.g. the trained and the flat methods of one experiment) name one folder, so that on a new
    # machine both restore the same experts and stage 0.
    shared: str | None = None
    grid: GridConfig = GridConfig()


def load_sweep(path: str | Path, overrides: list[str] = ()) -> tuple[SweepConfig, Path]:
    """Read a sweep file; ``base`` is resolved relative to the file. Errors name the key or file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"sweep file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"sweep file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"sweep file {str(p)!r} must hold a mapping at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or key not in SweepConfig.model_fields:
            raise ConfigError(
                f"sweep override {item!r}: expected one of {', '.join(SweepConfig.model_fields)}=value"
            )
        try:
            data[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            data[key] = raw
    try:
        sweep = SweepConfig.model_validate(data)
    except ValidationError as err:
        keys = ", ".join(".".join(str(x) for x in e["loc"]) + f" ({e['msg']})" for e in err.errors())
        raise ConfigError(f"invalid sweep file {str(p)!r}: {keys}") from None
    base = (p.parent / sweep.base) if not Path(sweep.base).is_absolute() else Path(sweep.base)
    if not base.is_file():
        base = Path(sweep.base)
    if not base.is_file():
        raise ConfigError(f"sweep file {str(p)!r}: base config {sweep.base!r} does not exist")
    if sweep.results is not None:
        _check_tracked(sweep, p, "results", "its cells/ would be the run folders")
    if sweep.shared is not None:
        if sweep.results is None:
            raise ConfigError(
                f"sweep file {str(p)!r}: shared: {sweep.shared!r} needs results: (the caches are kept "
                "for the cells exported there)"
            )
        _check_tracked(sweep, p, "shared", "the caches live there already")
    return sweep, base


def _check_tracked(sweep: SweepConfig, path: Path, key: str, why_not_root: str) -> None:
    """A tracked folder of the sweep file (``results`` or ``shared``): a folder (or none yet), never the root."""
    value = getattr(sweep, key)
    folder = Path(value).expanduser()
    for f in (folder, *folder.parents):  # the folder itself or one above it must not be a file
        if f.exists():
            if not f.is_dir():
                raise ConfigError(f"sweep file {str(path)!r}: {key}: {str(f)!r} exists and is not a folder")
            break
    if folder.resolve() == Path(sweep.root).expanduser().resolve():
        raise ConfigError(
            f"sweep file {str(path)!r}: {key}: {value!r} is the sweep's root ({why_not_root}); "
            "give another folder"
        )


def _tag(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in Path(text).name if c)[:40].strip("-") or "x"


def expand_cells(sweep: SweepConfig, base: Path) -> list[tuple[str, HamoConfig]]:
    """One validated ``HamoConfig`` per grid cell, named ``<method>-<model>-<order>-s<seed>``."""
    g = sweep.grid
    root = Path(sweep.root)
    orders: list[list[str] | None] = [list(o) for o in g.order] or [None]
    keys = list(g.vary)
    cells = []
    for method, model, order, seed, *varied in itertools.product(
        g.method, g.model, orders, g.seed, *(g.vary[k] for k in keys)
    ):
        extra = [f"method.name={method}", f"model.path={model}", f"run.seed={seed}"]
        extra += [f"{k}={json.dumps(v)}" for k, v in zip(keys, varied, strict=True)]
        vary_tag = "".join(
            f"-{k.rsplit('.', 1)[-1]}{_tag(str(v))}" for k, v in zip(keys, varied, strict=True)
        )
        order_tag = "default"
        if order is not None:
            order_tag = "".join(d[0].upper() for d in order)
            if len(order) == 1:
                extra += ["protocol.kind=within_domain", f"env.domain={order[0]}"]
            else:
                extra += ["protocol.kind=cross_domain", f"protocol.order=[{','.join(order)}]"]
        name = f"{method}-{_tag(model)}-{order_tag}{vary_tag}-s{seed}"
        shared = [f"env.expert_cache={root / 'experts'}"] if sweep.share_experts else []
        shared += [f"eval.initial_cache={root / 'initial'}"] if sweep.share_initial else []
        over = [*shared, *sweep.overrides, *extra, f"run.root={root / 'cells'}", f"run.id={name}"]
        cfg = load_config(base, over)
        cells.append((name, cfg))
    if sweep.run_order == "seed":  # a sweep stopped early then holds whole seeds: paired comparisons
        cells.sort(key=lambda cell: cell[1].run.seed)  # stable: grid order within a seed
    return cells


def setting_of(cfg: HamoConfig, vary: list[str] | tuple[str, ...] = ()) -> str:
    """The group a cell's seeds are aggregated in: backbone, domain order and the varied keys' values."""
    label = f"{_tag(cfg.model.path)}: {'->'.join(cfg.domains())}"
    for key in vary:
        value: Any = cfg
        for part in key.split("."):
            value = getattr(value, part)
        label += f", {key}={value}"
    return label
