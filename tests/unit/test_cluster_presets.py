"""cluster.yaml passes Ray's cluster-config schema; every preset in jobs/configs validates."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hamo_ray.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _api_key(monkeypatch):
    """The paper presets bind 0.0.0.0 and take their key from the environment (refused without one)."""
    monkeypatch.setenv("HAMO_API_KEY", "preset-test-key")


def test_cluster_yaml_matches_ray_schema():
    """``ray up`` prepares the local-provider config (min_workers moves to the node type), then validates it."""
    import json

    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert config["provider"]["type"] == "local"
    assert any("[gpu" in cmd for cmd in config["setup_commands"])
    prepared = prepare_config(config)
    validate_config(prepared)  # what `ray up` runs
    node_type = prepared["available_node_types"][prepared["head_node_type"]]
    assert node_type["min_workers"] == node_type["max_workers"] == 3
    broken = dict(prepared, provider={"head_ip": "x"})  # no provider type
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "jobs" / "configs").glob("*.yaml")))
def test_presets_validate(preset):
    if preset.startswith("sweep-"):
        from hamo_ray.sweep import expand_cells, load_sweep

        sweep, base = load_sweep(ROOT / "jobs" / "configs" / preset)
        assert expand_cells(sweep, base)
    else:
        cfg = load_config(ROOT / "jobs" / "configs" / preset)
        if preset.startswith("paper-"):  # the paper's cards are strategy-level: an LLM writes them
            assert (cfg.memory.distiller, cfg.memory.llm_base_url) == ("llm", "policy"), preset


def _commands(config: dict) -> list[str]:
    keys = [k for k in config if k.endswith("_commands")]
    return [cmd for k in keys for cmd in config[k] or []]


def test_cluster_yaml_commands_are_valid_shell_and_secure():
    import re
    import subprocess

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    commands = _commands(config)
    assert len(commands) >= 8
    for cmd in commands:
        check = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert check.returncode == 0, f"{cmd!r}: {check.stderr}"
        # A quoted ~ is expanded by neither the shell nor pip.
        assert not re.search(r"[\"']~", cmd), f"quoted ~ in {cmd!r}"
        assert "RAY_AUTH_MODE=disabled" not in cmd
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    head = next(c for c in config["head_start_ray_commands"] if "ray start" in c)
    assert "--dashboard-host=0.0.0.0" not in head and "--dashboard-host=127.0.0.1" in head
    assert "~/.ray/auth_token" in config["file_mounts"]  # the token reaches every node
    assert config["min_workers"] == len(config["provider"]["worker_ips"])


def test_cluster_yaml_tools_and_extras_exist():
    """Every program the setup runs from the venv is installed by the project's dependencies."""
    import re
    from importlib.metadata import distributions, entry_points

    import tomllib

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    scripts = {ep.name for ep in entry_points(group="console_scripts")}
    scripts |= {f.name for d in distributions() for f in d.files or [] if f.parent.name == "bin"}
    used = set(re.findall(r"\$HOME/hamo-venv/bin/([\w-]+)", " ".join(_commands(config))))
    assert {"ray", "pip", "hf", "alfworld-download"} <= used | {"pip"}
    assert used - {"pip", "python"} <= scripts, f"not installed by the project: {used - scripts}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra_list in re.findall(r'pip install -q -e "\.\[([\w,]+)\]"', " ".join(_commands(config))):
        assert set(extra_list.split(",")) <= set(extras)
    assert any("java" in c for c in config["initialization_commands"])


@pytest.mark.parametrize(
    ("preset", "gpus"),
    [("paper-qwen3-8b-within-1node.yaml", 8), ("paper-qwen3-14b-cross-2node.yaml", 16)],
)
def test_node_presets_fit_their_nodes(preset, gpus):
    from hamo_ray.run.gpu_plan import format_plan, gpu_plan

    plan = gpu_plan(load_config(ROOT / "jobs" / "configs" / preset), card_gib=80)
    assert plan.total_gpus == gpus
    assert plan.fits, format_plan(plan)
    assert 10 < plan.train_total_gib < 80
    assert plan.kv_cache_tokens > 8192


@pytest.mark.parametrize("size", ["8b", "14b"])
def test_large_presets_need_gradient_checkpointing(size):
    from hamo_ray.run.gpu_plan import gpu_plan

    cfg = load_config(ROOT / "jobs" / "configs" / f"paper-qwen3-{size}-within.yaml")
    assert cfg.train.gradient_checkpointing
    assert gpu_plan(cfg, card_gib=80).fits
    off = load_config(
        ROOT / "jobs" / "configs" / f"paper-qwen3-{size}-within.yaml", ["train.gradient_checkpointing=false"]
    )
    plan = gpu_plan(off, card_gib=80)
    assert not plan.fits and "gradient_checkpointing" in plan.problems[0]


def test_shape_estimate_matches_a_real_model(tmp_path):
    """The parameter count the memory estimate uses equals a real Qwen3 model's, and the Qwen3-8B shape is 8.2B."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hamo_ray.run.gpu_plan import KNOWN_SHAPES, model_shape

    for tied in (True, False):
        cfg = Qwen3Config(
            vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied,
        )  # fmt: skip
        model = Qwen3ForCausalLM(cfg)
        folder = tmp_path / f"tied-{tied}"
        model.save_pretrained(folder)
        shape, source = model_shape(load_config(None, [f"model.path={folder}"]))
        assert source.endswith("config.json")
        assert shape.params == sum(p.numel() for p in model.parameters())
    assert 8.1e9 < KNOWN_SHAPES["qwen3-8b"].params < 8.3e9
    assert 14.7e9 < KNOWN_SHAPES["qwen3-14b"].params < 14.9e9


def test_extends_merges_sections_and_rejects_cycles(tmp_path):
    from hamo_ray.config import ConfigError

    (tmp_path / "base.yaml").write_text("train:\n  epochs: 5\n  lr: 0.1\nrun:\n  seed: 3\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrain:\n  epochs: 1\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.train.epochs, cfg.train.lr, cfg.run.seed) == (1, 0.1, 3)
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "orphan.yaml").write_text("extends: missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml"):
        load_config(tmp_path / "orphan.yaml")
