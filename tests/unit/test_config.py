"""Config loading: defaults, YAML differences, dotted overrides, and errors that name the key."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hamo_ray.config import ConfigError, HamoConfig, load_config


def test_defaults_and_presets():
    cfg = load_config()
    assert (
        cfg.train.lora_r == 16
        and cfg.train.lora_alpha == 32
        and cfg.train.lr == 2e-4
        and cfg.train.epochs == 3
    )
    assert cfg.rollout.temperature == 0.7 and cfg.env.max_turns == 50
    assert cfg.method.retrieval and cfg.method.train and cfg.method.conditioning and cfg.method.selection
    base = load_config(overrides=["method.name=base"])
    assert not base.method.retrieval and not base.method.train and not base.method.uses_memory
    custom = load_config(overrides=["method.name=hamo", "method.replay=false"])
    assert custom.method.replay is False and custom.method.selection is True


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("train:\n  epochs: 5\nenv:\n  task_types: [boil]\n")
    cfg = load_config(f, ["train.epochs=1", "env.task_types=[melt, freeze]", "model.path=/x"])
    assert cfg.train.epochs == 1
    assert cfg.env.task_types == ["melt", "freeze"]
    assert cfg.model.path == "/x"


def test_config_is_frozen():
    cfg = HamoConfig()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.epochs = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.epoch=1", "train.epoch"),
        ("trian.epochs=1", "trian"),
        ("train.epochs=many", "train.epochs"),
        ("train=3", "section"),
        ("train.epochs.x=3", "not a section"),
        ("noequals", "key=value"),
        ("protocol.num_stages=0", "num_stages"),
    ],
)
def test_bad_overrides_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=[override])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lora_rank: 8\n")
    with pytest.raises(ConfigError, match="train.lora_rank"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(notmap)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["train.epochs=2"])
    f = tmp_path / "resolved.yaml"
    f.write_text(cfg.to_yaml())
    assert load_config(f) == cfg


def test_backbone_key_follows_the_experts_data() -> None:
    """A setting that changes a domain's expert data changes the cached backbone's key; others do not."""
    from hamo_ray.backbones.toy import backbone_key

    cross = "jobs/configs/tiny-cross.yaml"
    base = backbone_key(load_config(cross, []))
    assert backbone_key(load_config(cross, ["env.webshop.ids=short"])) != base
    assert backbone_key(load_config(cross, ["env.alfworld.seed=1"])) != base
    assert backbone_key(load_config(cross, ["train.lr=1e-3"])) == base
    # ScienceWorld-only: WebShop and ALFWorld settings do not touch the key (cached backbones stay valid)
    sw = backbone_key(load_config("jobs/configs/tiny.yaml", []))
    assert backbone_key(load_config("jobs/configs/tiny.yaml", ["env.webshop.ids=short"])) == sw


def test_backbone_per_task_per_domain() -> None:
    """``backbone.per_task`` one number, or one per domain of the stream (a missing domain is named)."""
    from hamo_ray.backbones.toy import backbone_key

    cross = "jobs/configs/tiny-cross.yaml"
    cfg = load_config(cross, ["backbone.per_task={scienceworld: 20, alfworld: 60, webshop: 40}"])
    assert [cfg.backbone_per_task(d) for d in cfg.domains()] == [20, 60, 40]
    assert backbone_key(cfg) != backbone_key(load_config(cross, []))
    assert load_config(cross, []).backbone_per_task("alfworld") == 20
    with pytest.raises(ConfigError, match="backbone.per_task has no entry for domain.*webshop"):
        load_config(cross, ["backbone.per_task={scienceworld: 20, alfworld: 60}"])
