"""The ``env`` section: common settings plus one section per domain, registered by the domain.

Per-domain sections validate and name their keys, the old flat keys are refused naming their new place,
a config saved in the old layout (a run folder's, a sweep export's) is upgraded and compares equal, and
every preset in jobs/configs loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from hamo_ray.config import (
    MOVED_ENV_KEYS,
    ConfigError,
    ConfigSection,
    EnvConfig,
    HamoConfig,
    env_sections,
    load_config,
    load_saved_config,
    upgrade_saved_config,
)
from hamo_ray.config import env as env_module
from hamo_ray.envs import base as envs_base
from hamo_ray.envs import get_domain
from hamo_ray.envs.base import Domain, register_domain

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))
TINY_CROSS = ROOT / "jobs" / "configs" / "tiny-cross.yaml"


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    """The paper presets bind 0.0.0.0 and take their key from the environment (refused without one)."""
    monkeypatch.setenv("HAMO_API_KEY", "preset-test-key")


# The env section of tiny-cross.yaml as the old layout saved it (a run folder's config.yaml before the
# per-domain sections): every field flat, the domains' settings among the common ones.
OLD_ENV = {
    "domain": "scienceworld",
    "task_types": {
        "scienceworld": ["lifespan-longest-lived", "find-living-thing"],
        "alfworld": ["pick_and_place_simple"],
        "webshop": ["beauty", "grocery"],
    },
    "max_turns": 20,
    "jvm_heap": "512m",
    "simplifications": "easy",
    "webshop_backend": "standin",
    "webshop_url": None,
    "webshop_products": 3000,
    "webshop_seed": 0,
    "webshop_ids": "asin",
    "textworld_games_dir": None,
    "expert_source": "simulator",
    "expert_files": {},
    "expert_cache": None,
    "alfworld_games": "generated",
    "alfworld_data": None,
    "alfworld_games_dir": None,
    "alfworld_seed": 0,
    "alfworld_games_per_task": 200,
}


def _old_layout(cfg: HamoConfig) -> dict:
    """``cfg`` dumped in the old flat env layout (the inverse of ``upgrade_saved_config``)."""
    data = cfg.model_dump(mode="json")
    env = data["env"]
    for old, new in MOVED_ENV_KEYS.items():
        domain, key = new.split(".")
        env[old] = env[domain][key]
    for domain in {new.split(".")[0] for new in MOVED_ENV_KEYS.values()}:
        del env[domain]
    return data


# -- the layout --------------------------------------------------------------------------------------


def test_every_domain_has_its_section_with_defaults():
    env = HamoConfig().env
    assert set(env_sections()) >= {"scienceworld", "alfworld", "textworld", "webshop"}
    assert env.scienceworld.jvm_heap == "512m" and env.webshop.backend == "standin"
    assert env.alfworld.games == "official" and env.textworld.games_dir is None
    assert env.section("webshop") is env.webshop
    common = set(EnvConfig.model_fields)
    assert common == {"domain", "task_types", "max_turns", "expert_source", "expert_files", "expert_cache"}
    dumped = HamoConfig().model_dump(mode="json")["env"]
    assert list(dumped)[: len(common)] == list(EnvConfig.model_fields)  # common keys first, then sections
    assert dumped["webshop"] == {
        "backend": "standin",
        "url": None,
        "products": 3000,
        "seed": 0,
        "ids": "asin",
    }
    with pytest.raises(ConfigError, match="env.nodomain"):
        env.section("nodomain")


def test_sections_from_a_file_and_overrides(tmp_path):
    f = tmp_path / "x.yaml"
    f.write_text("env:\n  domain: webshop\n  webshop:\n    backend: http\n    url: http://h:1\n")
    cfg = load_config(f, ["env.webshop.ids=short", "env.scienceworld.jvm_heap=1g"])
    assert (cfg.env.webshop.backend, cfg.env.webshop.url, cfg.env.webshop.ids) == (
        "http",
        "http://h:1",
        "short",
    )
    assert cfg.env.scienceworld.jvm_heap == "1g" and cfg.env.scienceworld.simplifications == "easy"
    assert cfg.env.alfworld.games == "official"  # untouched sections keep their defaults


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY_CROSS, ["env.webshop.ids=short", "env.alfworld.seed=3"])
    f = tmp_path / "resolved.yaml"
    f.write_text(cfg.to_yaml())
    assert load_config(f) == cfg
    assert HamoConfig.model_validate_json(cfg.model_dump_json()) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("env.scienceworld.heap=1g", "unknown config key 'env.scienceworld.heap'"),
        ("env.nodomain.x=1", "unknown config key 'env.nodomain'"),
        ("env.webshop.ids=long", "config key 'env.webshop.ids'"),
        ("env.alfworld.games_per_task=many", "config key 'env.alfworld.games_per_task'"),
        ("env.webshop=3", "'env.webshop' is a section"),
        ("env.webshop.backend.x=1", "'env.webshop.backend' is not a section"),
    ],
)
def test_bad_section_keys_are_named(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=[override])


def test_bad_section_keys_in_a_file_are_all_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("env:\n  scienceworld: {heap: 2g}\n  webshop: {ids: long}\n  alfworld: 3\n  bogus: 1\n")
    with pytest.raises(ConfigError) as err:
        load_config(f)
    msg = str(err.value)
    assert str(f) in msg
    for needle in (
        "unknown config key 'env.scienceworld.heap'",
        "config key 'env.webshop.ids'",
        "config key 'env.alfworld'",
        "unknown config key 'env.bogus'",
    ):
        assert needle in msg


@pytest.mark.parametrize("old", sorted(MOVED_ENV_KEYS))
def test_old_flat_keys_are_refused_naming_the_new_key(old, tmp_path):
    value = yaml.safe_dump(OLD_ENV[old]).strip().removesuffix("...").strip() or "null"
    needle = f"env.{old} is now env.{MOVED_ENV_KEYS[old]}"
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides=[f"env.{old}={value}"])
    f = tmp_path / "old.yaml"
    f.write_text(yaml.safe_dump({"env": {old: OLD_ENV[old]}}))
    with pytest.raises(ConfigError, match=needle):
        load_config(f)
    with pytest.raises(ValidationError, match=needle):
        EnvConfig(**{old: OLD_ENV[old]})


def test_a_domain_brings_its_own_section(monkeypatch):
    """A new domain registers its settings with the domain: no edit of ``EnvConfig``."""
    monkeypatch.setattr(env_module, "_SECTIONS", dict(env_module._SECTIONS))
    monkeypatch.setattr(envs_base, "_DOMAINS", dict(envs_base._DOMAINS))

    class ToyConfig(ConfigSection):
        rooms: int = 3

    @register_domain("toyland", config=ToyConfig)
    class ToyDomain(Domain):
        def task_types(self):
            return ["t"]

        def tasks(self, split, task_type, limit=None):
            return []

        def make_env(self):
            raise NotImplementedError

    cfg = load_config(overrides=["env.toyland.rooms=5"])
    assert cfg.env.toyland.rooms == 5 and get_domain("toyland", cfg.env).settings.rooms == 5
    assert HamoConfig().env.toyland == ToyConfig()
    with pytest.raises(ConfigError, match="unknown config key 'env.toyland.doors'"):
        load_config(overrides=["env.toyland.doors=1"])
    with pytest.raises(ConfigError, match="env.max_turns"):
        register_domain("max_turns", config=ToyConfig)(ToyDomain)


# -- saved configs in the old layout ------------------------------------------------------------------


def test_upgrade_moves_the_old_keys_and_changes_nothing_else():
    cfg = load_config(TINY_CROSS)
    old = {**cfg.model_dump(mode="json"), "env": dict(OLD_ENV)}
    up = upgrade_saved_config(old)
    assert old["env"] == OLD_ENV  # the input is not modified
    assert up["env"]["alfworld"]["games"] == "generated" and "alfworld_games" not in up["env"]
    assert up == cfg.model_dump(mode="json")
    assert HamoConfig.model_validate(up) == cfg
    assert upgrade_saved_config(up) == up  # idempotent
    assert upgrade_saved_config({"train": {"epochs": 1}}) == {"train": {"epochs": 1}}
    # A section the saved config holds gets the defaults of the keys it lacks (added after it was saved).
    partial = upgrade_saved_config({"env": {"alfworld_games": "generated"}})
    assert partial["env"]["alfworld"] == {**HamoConfig().env.alfworld.model_dump(), "games": "generated"}
    assert "webshop" not in partial["env"]


@pytest.mark.parametrize(
    "preset", [p for p in PRESETS if not p.name.startswith("sweep-")], ids=lambda p: p.stem
)
def test_every_preset_saved_in_the_old_layout_upgrades_to_itself(preset):
    cfg = load_config(preset)
    assert HamoConfig.model_validate(upgrade_saved_config(_old_layout(cfg))) == cfg


def _run_folder(tmp_path: Path, cfg: HamoConfig):
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.types import StageResult

    folder = RunFolder(tmp_path / cfg.run.id, cfg)
    folder.prepare()
    stage = StageResult(stage=1, method=cfg.method.name, num_trajectories=1, num_cards=1, budget=1,
                        anchors=[], replay=[], adapter=None, adapter_name=None, train_loss=None,
                        scores={"scienceworld": 1.0}, seconds={})  # fmt: skip
    folder.commit(stage)
    return folder


def test_a_run_folder_saved_in_the_old_layout_resumes(tmp_path):
    from hamo_ray.run.folder import RunFolder

    cfg = load_config(TINY_CROSS, [f"run.root={tmp_path}", "run.id=r1", "env.webshop.ids=short"])
    folder = _run_folder(tmp_path, cfg)
    saved = folder.path / "config.yaml"
    saved.write_text(yaml.safe_dump(_old_layout(cfg), sort_keys=False))
    assert "webshop_ids: short" in saved.read_text()
    assert [s.stage for s in RunFolder(folder.path, cfg).prepare()] == [1]  # same config: resumes
    assert load_saved_config(saved) == cfg  # and the saved file is read (jobs/serve.py)
    with pytest.raises(ConfigError, match="env.webshop"):  # a real change is still one
        RunFolder(folder.path, load_config(TINY_CROSS, [f"run.root={tmp_path}", "run.id=r1"])).prepare()
    with pytest.raises(ConfigError, match="env.webshop_ids is now env.webshop.ids"):
        load_config(saved)  # a preset in the old layout is refused; only saved configs are upgraded


def test_a_sweep_export_saved_in_the_old_layout_is_not_stale(tmp_path):
    from hamo_ray.sweep import stale_keys

    cfg = load_config(TINY_CROSS, ["env.alfworld.games_per_task=500"])
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.yaml").write_text(yaml.safe_dump(_old_layout(cfg), sort_keys=False))
    assert stale_keys(export, cfg) == []
    changed = load_config(TINY_CROSS, ["env.alfworld.games_per_task=500", "env.alfworld.seed=2"])
    assert stale_keys(export, changed) == ["env.alfworld.seed"]


def test_the_training_engine_may_change_on_resume_and_in_an_export(tmp_path):
    """train.engine, max_failures, storage, keep_workers change how a stage trains, not what it computes."""
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.sweep import stale_keys

    cfg = load_config(TINY_CROSS, [f"run.root={tmp_path}", "run.id=r2", "train.engine=actors"])
    folder = _run_folder(tmp_path, cfg)
    moved = [
        "train.engine=ray_train",
        "train.max_failures=5",
        f"train.storage={tmp_path}/rt",
        "train.keep_workers=false",
    ]
    again = load_config(TINY_CROSS, [f"run.root={tmp_path}", "run.id=r2", *moved])
    assert [s.stage for s in RunFolder(folder.path, again).prepare()] == [1]
    assert stale_keys(folder.path, again) == []
    assert stale_keys(
        folder.path, load_config(TINY_CROSS, [f"run.root={tmp_path}", "run.id=r2", "train.lr=0.1"])
    ) == ["train.lr"]


# -- the presets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_loads(preset):
    if preset.name.startswith("sweep-"):
        from hamo_ray.sweep import expand_cells, load_sweep

        sweep, base = load_sweep(preset)
        assert expand_cells(sweep, base)
    else:
        cfg = load_config(preset)
        assert set(cfg.domains()) <= set(env_sections())


def test_per_domain_counts_still_work_beside_the_sections():
    cfg = load_config(
        TINY_CROSS,
        ["protocol.train_per_task={scienceworld: 6, alfworld: 4, webshop: 5}", "env.webshop.ids=short"],
    )
    assert [cfg.per_domain("protocol.train_per_task", d) for d in cfg.domains()] == [6, 4, 5]
    assert cfg.per_domain("protocol.test_per_task", "alfworld") == 3
    assert cfg.task_types("webshop") == ["beauty", "grocery"] and cfg.env.webshop.ids == "short"
