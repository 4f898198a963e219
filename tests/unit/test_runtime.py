"""``hamo_ray.run.services`` without Ray: the cluster rule, the client spec, names, adapter publishing paths."""

from __future__ import annotations

import json

import pytest

from hamo_ray.config import ConfigError, RayConfig, load_config
from hamo_ray.rollout.client import PolicyClient
from hamo_ray.run.cluster import cluster_address, local_cpus
from hamo_ray.run.folder import PhaseClock, RunFolder
from hamo_ray.run.services import Endpoint, Services


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    """No RAY_ADDRESS and an empty Ray temp folder: nothing to join."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(
        "ray._private.utils.get_ray_address_file", lambda temp_dir=None: str(tmp_path / "none")
    )


def test_cluster_rule(no_cluster, monkeypatch, tmp_path):
    assert cluster_address(RayConfig()) is None  # nothing running: a private Ray
    assert cluster_address(RayConfig(address="local")) is None
    assert cluster_address(RayConfig(address="10.0.0.1:6379")) == "10.0.0.1:6379"
    # A `ray start` on this machine (maybe another user's) is joined only when asked: ray.address=auto.
    (tmp_path / "current").write_text("127.0.0.1:6380\n")
    monkeypatch.setattr(
        "ray._private.utils.get_ray_address_file", lambda temp_dir=None: str(tmp_path / "current")
    )
    assert cluster_address(RayConfig()) is None
    assert cluster_address(RayConfig(address="auto")) == "auto"
    assert cluster_address(RayConfig(address="local")) is None  # forced private
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # what `ray job submit` sets wins
    assert cluster_address(RayConfig()) == "http://head:8265"


def test_one_resource_rule(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert local_cpus(RayConfig()) == 8
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert local_cpus(RayConfig()) == 64
    assert local_cpus(RayConfig(num_cpus=3)) == 3


def test_spec_carries_the_key_and_the_harness_only_with_retrieval(tmp_path):
    cfg = load_config(None, ["rollout.temperature=0.3", "memory.top_k=4", "serve.api_key=k1"])
    ep = Endpoint("http://h:1", "http://h:1/harness", cfg.serve.api_key)
    spec = ep.spec("stage-2", cfg, seed=5, retrieval=True)
    assert (spec.model, spec.temperature, spec.top_k, spec.seed, spec.api_key) == ("stage-2", 0.3, 4, 5, "k1")
    assert spec.harness_url == "http://h:1/harness"
    assert ep.spec("base", cfg, seed=0).harness_url is None
    assert not spec.constrain_actions  # off by default
    constrained = load_config(None, ["rollout.constrain_actions=true"])
    assert ep.spec("stage-2", constrained, seed=5).constrain_actions
    assert "k1" not in repr(spec)  # the key stays out of logs
    client = PolicyClient(spec)
    assert client._http.headers["Authorization"] == "Bearer k1"
    assert "Authorization" not in PolicyClient(Endpoint("http://h:1").spec("b", cfg, seed=0))._http.headers
    assert spec.base_url == "http://h:1" and spec.fallback_url is None


def test_spec_sends_chats_to_the_replicas_own_port_with_the_route_as_fallback():
    cfg = load_config(None, [])
    spec = Endpoint("http://h:1/policy", "http://h:1/harness", direct_url="http://h:5").spec("m", cfg, seed=0)
    assert (spec.base_url, spec.fallback_url) == ("http://h:5", "http://h:1/policy")
    assert cfg.serve.direct_rollouts and cfg.serve.num_replicas == 1  # the default: one replica, direct


def _folder(tmp_path, *overrides):
    cfg = load_config(None, [f"run.root={tmp_path}", *overrides])
    folder = RunFolder(tmp_path / "r", cfg)
    folder.prepare()
    return cfg, folder


def test_names_owned_and_shared(tmp_path):
    cfg, folder = _folder(tmp_path)
    assert Services(cfg, folder).adapter_name(3) == "stage-3"
    assert Services(cfg, folder).adapter_name(3, "-bc") == "stage-3-bc"
    shared = Services(cfg, folder, shared_url="http://h:1", run_id="cell-a")
    assert shared.adapter_name(3) == "cell-a-stage-3"
    digest = "0123456789abcdef" * 4
    assert Services(cfg, folder).adapter_name(3, "-bc", digest) == "stage-3-bc:0123456789ab"
    assert shared.adapter_name(3, "", digest) == "cell-a-stage-3:0123456789ab"


def _adapter(path):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (path / "adapter_model.safetensors").write_bytes(b"weights-1")
    return path


def test_adapters_go_through_a_store_folder(tmp_path):
    store = tmp_path / "shared-adapters"
    cfg, folder = _folder(tmp_path, f"serve.adapter_store={store}")
    services = Services(cfg, folder)
    assert services.adapter_root == str(store.resolve() / "r")  # the run's own prefix: <store>/<run id>
    local = _adapter(folder.path / "adapters" / "stage-1")
    assert services._served_path(local) == "stage-1"
    assert (store / "r" / "stage-1" / "adapter_model.safetensors").read_bytes() == b"weights-1"
    # A redone stage (same name, new weights) replaces the stored copy.
    (local / "adapter_model.safetensors").write_bytes(b"weights-2")
    services._served_path(local)
    assert (store / "r" / "stage-1" / "adapter_model.safetensors").read_bytes() == b"weights-2"


def test_no_store_or_the_runs_own_folder_publishes_in_place(tmp_path):
    cfg, folder = _folder(tmp_path)
    local = _adapter(folder.path / "adapters" / "stage-1")
    assert Services(cfg, folder)._served_path(local) == str(local)
    cfg2, folder2 = _folder(tmp_path, f"serve.adapter_store={folder.path / 'adapters'}")
    services = Services(cfg2, folder2)
    assert services._store is None and services._served_path(local) == str(local)


def test_a_bad_store_uri_is_a_config_error(tmp_path):
    cfg, folder = _folder(tmp_path, "serve.adapter_store=s3://bucket/x?no_such_option=1")
    with pytest.raises(ConfigError, match="serve.adapter_store"):
        Services(cfg, folder)


def test_phase_clock_adds_up_and_records_into_a_dict():
    into: dict[str, float] = {"backbone": 1.0}
    clock = PhaseClock(into)
    with clock("train"):
        pass
    with clock("backbone"):
        pass
    assert set(into) == {"backbone", "train"} and into["backbone"] >= 1.0 and into["train"] >= 0.0
    with pytest.raises(RuntimeError), clock("evaluate"):
        raise RuntimeError("boom")
    assert "evaluate" in clock.seconds
