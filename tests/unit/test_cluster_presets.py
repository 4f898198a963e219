"""cluster.yaml passes Ray's cluster-config schema; every preset in jobs/configs validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hamo_ray.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_matches_ray_schema():
    import json

    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)  # the schema `ray up` validates against
    assert config["provider"]["type"] == "local"
    assert any("[gpu" in cmd for cmd in config["setup_commands"])
    broken = dict(config, provider={"head_ip": "x"})  # no provider type
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "jobs" / "configs").glob("*.yaml")))
def test_presets_validate(preset):
    if preset.startswith("sweep-"):
        from hamo_ray.sweep import expand_cells, load_sweep

        sweep, base = load_sweep(ROOT / "jobs" / "configs" / preset)
        assert expand_cells(sweep, base)
    else:
        load_config(ROOT / "jobs" / "configs" / preset)
