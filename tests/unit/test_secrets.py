"""Secrets and exposure (hamo_ray/config/secrets.py): keys come from the command line, the environment
or a file, and appear in no file a run writes (config.yaml, state, results, tracker output, a sweep
export), in no ``--print-config`` output and in no error message; an endpoint reachable from other
machines needs a key; the ScienceWorld JVM's py4j gateway refuses a connection without its token.
"""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from hamo_ray.config import MASK, ConfigError, HamoConfig, load_config, load_saved_config
from hamo_ray.config.secrets import SECRET_ENV, is_loopback, mask_secrets

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "jobs" / "configs" / "tiny.yaml"
KEY = "sk-serve-9f8e7d6c5b4a"
LLM_KEY = "sk-llm-0a1b2c3d4e5f"
S3_SECRET = "s3-secret-77aa88bb99cc"
SECRETS = (KEY, LLM_KEY, S3_SECRET)
ALL_VARS = [v for pair in SECRET_ENV.values() for v in pair]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No secret from the developer's shell leaks into these tests."""
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)


def _given(how: str, tmp_path: Path, monkeypatch) -> list[str]:
    """Give the three secrets ``how`` ("cli", "env" or "file"); returns the overrides to load with."""
    options = f"{{aws_access_key_id: AKIA0000, aws_secret_access_key: {S3_SECRET}}}"
    if how == "cli":
        return [f"serve.api_key={KEY}", f"memory.llm_api_key={LLM_KEY}", f"memory.storage_options={options}"]
    if how == "env":
        monkeypatch.setenv("HAMO_API_KEY", KEY)
        monkeypatch.setenv("HAMO_LLM_API_KEY", LLM_KEY)
        monkeypatch.setenv("HAMO_STORAGE_OPTIONS", options)
        return []
    secrets = tmp_path / "secrets"
    secrets.mkdir(exist_ok=True)
    for var, text in (("HAMO_API_KEY_FILE", KEY), ("HAMO_LLM_API_KEY_FILE", LLM_KEY),
                      ("HAMO_STORAGE_OPTIONS_FILE", options)):  # fmt: skip
        f = secrets / var.lower()
        f.write_text(text + "\n")
        f.chmod(0o600)
        monkeypatch.setenv(var, str(f))
    return []


def _grep(folder: Path, needles=SECRETS) -> list[str]:
    """Files under ``folder`` holding any of ``needles`` (bytes, so binary event files count too)."""
    hits = []
    for f in folder.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            hits += [f"{f.relative_to(folder)}: {n}" for n in needles if n.encode() in data]
    return hits


# -- where a key comes from ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["cli", "env", "file"])
def test_each_source_supplies_the_keys(how, tmp_path, monkeypatch):
    cfg = load_config(TINY, _given(how, tmp_path, monkeypatch))
    assert cfg.serve.api_key == KEY and cfg.memory.llm_api_key == LLM_KEY
    assert cfg.memory.storage_options["aws_secret_access_key"] == S3_SECRET
    assert not any(s in repr(cfg) or s in str(cfg) for s in SECRETS)  # reprs leave them out


def test_precedence_and_refusals(tmp_path, monkeypatch):
    (tmp_path / "k.yaml").write_text("serve:\n  api_key: from-file-config\n")
    assert load_config(tmp_path / "k.yaml").serve.api_key == "from-file-config"
    monkeypatch.setenv("HAMO_API_KEY", "from-env")
    assert load_config(tmp_path / "k.yaml").serve.api_key == "from-env"  # the environment beats the file
    assert load_config(tmp_path / "k.yaml", ["serve.api_key=0123"]).serve.api_key == "0123"  # a string
    key_file = tmp_path / "key"
    key_file.write_text("from-key-file\n")
    monkeypatch.setenv("HAMO_API_KEY_FILE", str(key_file))
    with pytest.raises(ConfigError, match="HAMO_API_KEY and HAMO_API_KEY_FILE are both set"):
        load_config()
    monkeypatch.delenv("HAMO_API_KEY")
    assert load_config().serve.api_key == "from-key-file"
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="HAMO_API_KEY_FILE=.*empty"):
        load_config()
    monkeypatch.setenv("HAMO_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="HAMO_API_KEY_FILE=.*cannot read"):
        load_config()
    monkeypatch.delenv("HAMO_API_KEY_FILE")
    monkeypatch.setenv("HAMO_STORAGE_OPTIONS", f"not a mapping {S3_SECRET}")
    with pytest.raises(ConfigError, match="HAMO_STORAGE_OPTIONS must hold") as err:
        load_config()
    assert S3_SECRET not in str(err.value)
    monkeypatch.setenv("HAMO_STORAGE_OPTIONS", '{"region": "eu", "aws_secret_access_key": "x"}')
    merged = load_config(None, ["memory.storage_options={region: us}"]).memory.storage_options
    assert merged == {"region": "us"}  # the command line beats the environment, whole


def test_error_messages_mask_secrets():
    cases = [
        [f"serve.api_key={KEY}", "train.lora_r=64"],  # a root-level check: its input is the whole config
        [f"serve.api_key={KEY}", "serve.adapter_store=zz://x"],  # a section check: the serve section
        [f"memory.llm_api_key={LLM_KEY}", "memory.llm_concurrency=0"],
        [f"memory.storage_options={{key: {S3_SECRET}, n: [1]}}"],  # a bad value inside the mapping
        [f"serve.apikey={KEY}"],  # a misspelt key: the override is shown without its value
        [f"serve.api_key.x={KEY}"],
    ]
    for overrides in cases:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        assert not any(s in str(err.value) for s in SECRETS), str(err.value)


def test_mask_secrets_of_a_dump_and_of_a_section():
    cfg = load_config(None, [f"serve.api_key={KEY}", f"memory.storage_options={{a: {S3_SECRET}}}"])
    dump = mask_secrets(cfg.model_dump(mode="json"))
    assert dump["serve"]["api_key"] == MASK and dump["memory"]["storage_options"] == {"a": MASK}
    assert dump["memory"]["llm_api_key"] == "EMPTY"  # the placeholder of "no key" is shown as it is
    assert cfg.serve.api_key == KEY  # the config itself keeps the real value for the code that needs it
    assert mask_secrets(cfg.serve.model_dump(), ("serve",))["api_key"] == MASK
    assert HamoConfig().public_dump()["serve"]["api_key"] is None


# -- exposure --------------------------------------------------------------------------------------------


def test_a_host_beyond_loopback_needs_a_key(monkeypatch):
    for host in ("0.0.0.0", "::", "10.1.2.3", "node-7.cluster"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"serve.host='{host}'"])
        assert "serve.api_key" in str(err.value) and "HAMO_API_KEY" in str(err.value)
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        assert is_loopback(host) and load_config(None, [f"serve.host='{host}'"]).serve.api_key is None
    assert load_config(None, ["serve.host=0.0.0.0", f"serve.api_key={KEY}"]).serve.api_key == KEY
    monkeypatch.setenv("HAMO_API_KEY", KEY)
    assert load_config(None, ["serve.host=0.0.0.0"]).serve.api_key == KEY


@pytest.mark.parametrize("preset", sorted(p.name for p in (ROOT / "jobs" / "configs").glob("paper-*.yaml")))
def test_paper_presets_take_their_key_from_the_environment(preset, monkeypatch):
    with pytest.raises(ConfigError, match=r"serve\.api_key.*HAMO_API_KEY"):
        load_config(ROOT / "jobs" / "configs" / preset)
    monkeypatch.setenv("HAMO_API_KEY", KEY)
    cfg = load_config(ROOT / "jobs" / "configs" / preset)
    assert cfg.serve.host == "0.0.0.0" and cfg.serve.api_key == KEY


# -- nothing written holds a secret -------------------------------------------------------------------


def _fake_backends(monkeypatch, store: Path) -> None:
    """W&B and MLflow stand-ins that write what they are given to files under ``store``."""

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    def record(name: str, what) -> None:
        store.mkdir(parents=True, exist_ok=True)
        with open(store / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(what, default=str) + "\n")

    run = types.SimpleNamespace(define_metric=lambda *a, **k: None, log=lambda v: record("wandb-log", v),
                                finish=lambda: None)  # fmt: skip
    module("wandb", init=lambda **kw: (record("wandb-init", kw), run)[1])
    module("mlflow", set_tracking_uri=lambda uri: None, set_experiment=lambda name: None,
           start_run=lambda **kw: object(), log_params=lambda p: record("mlflow-params", p),
           log_metrics=lambda m, step: record("mlflow-metrics", m), end_run=lambda: None)  # fmt: skip


@pytest.mark.parametrize("how", ["cli", "env", "file"])
def test_no_file_of_a_run_folder_tracker_or_export_holds_a_key(how, tmp_path, monkeypatch):
    from hamo_ray.run.folder import RunFolder
    from hamo_ray.run.tracking import Tracker, stage_scalars
    from hamo_ray.sweep.export import export_cell, stale_keys
    from hamo_ray.types import StageResult

    runs = tmp_path / "runs"
    monkeypatch.setenv("WANDB_MODE", "offline")  # what Tracker sets, undone after the test
    _fake_backends(monkeypatch, runs / "r" / "tracker")
    over = [*_given(how, tmp_path, monkeypatch), f"run.root={runs}", "run.id=r",
            "run.tracking=[tensorboard, wandb, mlflow]"]  # fmt: skip
    cfg = load_config(TINY, over)
    assert cfg.serve.api_key == KEY
    folder = RunFolder(runs / "r", cfg)
    assert folder.prepare() == []
    tracker = Tracker(folder.path, cfg.run.tracking, "stream", cfg.model_dump(mode="json"))  # as Stream does
    stage = StageResult(stage=1, method=cfg.method.name, num_trajectories=1, num_cards=1, budget=1,
                        anchors=[], replay=[], adapter=None, adapter_name=None, train_loss=None,
                        scores={"scienceworld": 50.0}, seconds={"train": 1.0})  # fmt: skip
    folder.commit(stage)
    tracker.log(stage_scalars(stage), step=1)
    tracker.close()
    export = export_cell(folder.path, tmp_path / "results" / "cells" / "r")

    params = json.loads((folder.path / "tracker" / "mlflow-params.jsonl").read_text())
    assert params["serve.api_key"] == MASK and params["memory.llm_api_key"] == MASK
    init = json.loads((folder.path / "tracker" / "wandb-init.jsonl").read_text())
    assert init["config"]["memory"]["storage_options"]["aws_secret_access_key"] == MASK
    saved = yaml.safe_load((folder.path / "config.yaml").read_text())
    assert saved["serve"]["api_key"] == MASK and saved["memory"]["llm_api_key"] == MASK
    assert saved["memory"]["storage_options"] == {"aws_access_key_id": MASK, "aws_secret_access_key": MASK}
    assert any((folder.path / "tensorboard").rglob("events.*"))
    assert _grep(tmp_path / "runs") == [] and _grep(export) == []
    assert stale_keys(export, cfg) == []  # a masked export still matches the config that made it

    # A resume with the keys given again (from wherever) is the same run: secrets are never compared.
    resumed = load_config(TINY, [*over, "run.resume=true"])
    assert [s.stage for s in RunFolder(runs / "r", resumed).prepare()] == [1]
    other = load_config(TINY, [*over, "run.resume=true", "serve.api_key=another", "memory.llm_api_key=x"])
    assert [s.stage for s in RunFolder(runs / "r", other).prepare()] == [1]
    # Read back, the saved config holds no masked value: the key comes from where it is given.
    if how == "cli":
        monkeypatch.setenv("HAMO_API_KEY", "served-with")
    back = load_saved_config(folder.path / "config.yaml")
    assert back.serve.api_key in (KEY, "served-with") and MASK not in json.dumps(back.model_dump())
    if how == "cli":  # nothing in the environment gives the other secrets: they read as unset
        assert back.memory.llm_api_key == "EMPTY" and back.memory.storage_options == {}


def test_an_export_of_an_older_run_folder_masks_its_key(tmp_path):
    """A run folder written before secrets were masked holds its key; its export (git-tracked) does not."""
    from hamo_ray.sweep.export import export_cell, stale_keys

    cfg = load_config(TINY, [f"serve.api_key={KEY}", f"memory.storage_options={{k: {S3_SECRET}}}"])
    old = tmp_path / "old"
    (old / "results").mkdir(parents=True)
    (old / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    (old / "results" / "metrics.json").write_text("{}")
    export = export_cell(old, tmp_path / "results" / "cells" / "old")
    assert _grep(export) == [] and stale_keys(export, cfg) == []
    assert yaml.safe_load((export / "config.yaml").read_text())["serve"]["api_key"] == MASK


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ALL_VARS}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**base, **(env or {})})  # fmt: skip


def test_print_config_shows_no_key(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    stream = ["jobs/stream.py", "--config", str(TINY), "--print-config"]
    for extra, env in [
        ([f"serve.api_key={KEY}", f"memory.llm_api_key={LLM_KEY}"], None),
        ([], {"HAMO_API_KEY": KEY, "HAMO_STORAGE_OPTIONS": f"{{secret: {S3_SECRET}}}"}),
        (["serve.host=0.0.0.0"], {"HAMO_API_KEY_FILE": str(key_file), "HAMO_LLM_API_KEY": LLM_KEY}),
    ]:
        out = _run(*stream, *extra, env=env)
        assert out.returncode == 0, out.stderr
        assert not any(s in out.stdout + out.stderr for s in SECRETS)
        assert yaml.safe_load(out.stdout)["serve"]["api_key"] == MASK
    sweep = _run("jobs/sweep.py", "--config", "jobs/configs/sweep-tiny.yaml", "--print-config",
                 env={"HAMO_API_KEY": KEY})  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr
    assert KEY not in sweep.stdout + sweep.stderr and sweep.stdout.count(f"api_key: '{MASK}'") == 8


def test_front_doors_refuse_an_open_host_naming_the_key(tmp_path):
    out = _run("jobs/stream.py", "--config", str(TINY), "serve.host=0.0.0.0", "--print-config")
    assert out.returncode == 2 and "serve.api_key" in out.stderr and "HAMO_API_KEY" in out.stderr
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config(TINY, [f"serve.api_key={KEY}"]).to_yaml())
    serve = ["jobs/serve.py", "--run", str(run), "--host", "0.0.0.0", "--print-config"]
    out = _run(*serve)
    assert out.returncode == 2 and "serve.api_key" in out.stderr and "HAMO_API_KEY" in out.stderr
    out = _run(*serve, env={"HAMO_API_KEY": KEY})
    assert out.returncode == 0 and KEY not in out.stdout + out.stderr
    assert yaml.safe_load(out.stdout)["serve"]["host"] == "0.0.0.0"


# -- the ScienceWorld JVM's gateway ---------------------------------------------------------------------


def test_the_scienceworld_gateway_refuses_a_connection_without_its_token():
    from py4j.java_gateway import GatewayParameters, JavaGateway
    from py4j.protocol import Py4JError

    from hamo_ray.envs.scienceworld_jvm import capped_env_class

    env = capped_env_class()("256m")
    try:
        params = env._gateway.gateway_parameters
        assert params.auth_token and len(params.auth_token) >= 16
        assert "boil" in env.get_task_names()  # the env's own connection presents the token
        for token in (None, "not-the-token"):
            intruder = JavaGateway(gateway_parameters=GatewayParameters(port=params.port, auth_token=token))
            try:
                with pytest.raises(Py4JError, match="(?i)authenticat"):
                    intruder.jvm.java.lang.System.getProperty("user.name")
            finally:
                intruder.close()
        assert "boil" in env.get_task_names()  # still serving its own client
    finally:
        env.close()
