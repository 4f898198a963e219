"""Runs beside each other on one cluster, store or memory URI (``hamo_ray.naming``), without Ray: the names
each run derives from its id, the refusal of an app a job did not create, the default that joins no
cluster unasked. Two real streams on one ``ray start`` cluster: ``tests/ray/test_isolation.py``."""

from __future__ import annotations

import os
import socket
import types

import lancedb
import pytest

from hamo_ray import naming
from hamo_ray.config import ConfigError, RayConfig, ServeConfig, load_config
from hamo_ray.memory.store import MemoryStore
from hamo_ray.naming import (
    APPS_FILE,
    AppExistsError,
    cell_harness_names,
    claim_apps,
    leftovers,
    memory_table,
    read_record,
    release_apps,
    serve_names,
    shared_serve_names,
    slug,
    store_prefix,
    sweep_name,
)
from hamo_ray.run.cluster import cluster_address
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.serve_apps import shared_serve_cfg
from hamo_ray.run.services import Services


def test_slug_keeps_a_plain_id_and_makes_any_other_one_safe_and_distinct():
    assert slug("tiny-hamo-s0") == "tiny-hamo-s0" and slug("a_b.c") == "a_b.c"
    odd = slug("my run/1")
    assert odd.startswith("my-run-1-") and len(odd) == len("my-run-1-") + 8
    assert slug("my run/1") != slug("my run:1")  # same clean text, different ids: different names
    assert slug("") == slug("") and slug("///")  # never empty


def test_serve_names_derive_from_the_run_id_unless_given():
    assert serve_names(ServeConfig(), "tiny-hamo-s0") == (
        "hamo-tiny-hamo-s0", "/tiny-hamo-s0", "hamo-tiny-hamo-s0-harness", "/tiny-hamo-s0/harness"
    )  # fmt: skip
    assert serve_names(ServeConfig(), "a")[:2] != serve_names(ServeConfig(), "b")[:2]
    # An explicit name and route (an old run folder's config.yaml holds hamo at /) are used as they are.
    assert serve_names(ServeConfig(app_name="hamo", route_prefix="/"), "x") == (
        "hamo",
        "/",
        "hamo-harness",
        "/harness",
    )
    assert serve_names(ServeConfig(app_name="mine"), "x")[:2] == ("mine", "/x")


def test_a_sweeps_shared_endpoints_are_named_after_the_sweep_and_its_cells_after_themselves(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path / 'sweep-a' / 'cells'}", "run.id=hamo-embedded-default-s0"])
    assert sweep_name(cfg.run.root) == "sweep-a"
    assert shared_serve_names(cfg.serve, "sweep-a", 1) == ("hamo-sweep-a-1", "/sweep-a/1")
    scfg = shared_serve_cfg(cfg, 0)
    assert (scfg.app_name, scfg.route_prefix) == ("hamo-sweep-a-0", "/sweep-a/0")
    other = load_config(None, [f"run.root={tmp_path / 'sweep-b' / 'cells'}"])
    assert shared_serve_cfg(other, 0).app_name == "hamo-sweep-b-0"  # another sweep: another app
    assert cell_harness_names(cfg.serve, "sweep-a", "http://h:8000/sweep-a/0", "c1") == (
        "hamo-sweep-a-harness-c1", "/sweep-a/0/harness-c1"
    )  # fmt: skip
    folder = RunFolder(tmp_path / "sweep-a" / "cells" / "c1", cfg)
    shared = Services(cfg, folder, shared_url="http://h:8000/sweep-a/0", run_id="c1")
    assert shared.app_names() == (None, None, "hamo-sweep-a-harness-c1", "/sweep-a/0/harness-c1")
    # explicit serve.app_name (the slow sweep test's): hamo-sweep-test-<i>, and the cells' harness apps
    named = load_config(None, [f"run.root={tmp_path / 's' / 'cells'}", "serve.app_name=hamo-sweep-test"])
    assert shared_serve_cfg(named, 2).app_name == "hamo-sweep-test-2"


def test_the_memory_table_is_the_run_ids_in_a_shared_uri_only(tmp_path):
    assert memory_table(load_config(None, []).memory, "r1") == "cards"  # the run folder's own memory
    shared = load_config(None, [f"memory.uri={tmp_path / 'mem'}"]).memory
    assert memory_table(shared, "r1") == "cards-r1" and memory_table(shared, None) == "cards"
    # Two runs on one memory.uri: two tables, neither sees the other's cards.
    for run in ("r1", "r2"):
        cfg = load_config(None, [f"run.root={tmp_path / 'runs'}", f"memory.uri={tmp_path / 'mem'}"])
        store = RunFolder(tmp_path / "runs" / run, cfg).store(cfg)
        assert store.table_name == f"cards-{run}"
        MemoryStore.from_config(str(tmp_path / "mem"), cfg.memory, dim=4, run_id=run)  # creates it
    db = lancedb.connect(str(tmp_path / "mem"))
    assert {db.open_table(t).name for t in ("cards-r1", "cards-r2")} == {"cards-r1", "cards-r2"}
    with pytest.raises((ValueError, FileNotFoundError)):
        db.open_table("cards")  # no shared table that both would write
    own = load_config(None, [f"run.root={tmp_path / 'runs'}"])
    assert RunFolder(tmp_path / "runs" / "r3", own).store(own).table_name == "cards"  # old folders readable


def test_adapter_store_paths_are_prefixed_by_the_run_id(tmp_path):
    assert (
        store_prefix("s3://bucket/adapters?region=eu-west-1", "r1")
        == "s3://bucket/adapters/r1?region=eu-west-1"
    )
    assert store_prefix("file:///shared/adapters/", "r1") == "file:///shared/adapters/r1"
    assert store_prefix(str(tmp_path / "store"), "r1") == str((tmp_path / "store" / "r1").resolve())
    roots = []
    for run in ("r1", "r2"):
        cfg = load_config(
            None, [f"run.root={tmp_path / 'runs'}", f"serve.adapter_store={tmp_path / 'store'}"]
        )
        folder = RunFolder(tmp_path / "runs" / run, cfg)
        folder.prepare()
        services = Services(cfg, folder)
        roots.append(services.adapter_root)
        local = folder.adapters_dir / "stage-1"
        local.mkdir(parents=True)
        (local / "adapter_config.json").write_text("{}")
        (local / "adapter_model.safetensors").write_bytes(run.encode())
        assert services._served_path(local) == "stage-1"  # the served name stays stage-<t>
    assert roots == [str((tmp_path / "store" / r).resolve()) for r in ("r1", "r2")]
    for run in ("r1", "r2"):  # neither overwrote the other's weights
        assert (
            tmp_path / "store" / run / "stage-1" / "adapter_model.safetensors"
        ).read_bytes() == run.encode()


def test_an_app_this_job_did_not_create_is_refused_naming_it():
    here = socket.gethostname()
    assert leftovers(["hamo-a"], [], {}, "c") == []  # nothing runs under that name
    with pytest.raises(
        AppExistsError, match="'hamo-a' already runs.*not deployed by a job on this run folder"
    ):
        leftovers(["hamo-a"], ["hamo-a", "x"], {}, "c")
    assert issubclass(AppExistsError, ConfigError)  # the jobs print it and exit 2
    dead = {"hamo-a": {"cluster": "c", "host": here, "pid": 1234}}
    # The leftover of a killed attempt of this run folder on this cluster: replaced by the resubmission.
    assert leftovers(["hamo-a"], ["hamo-a"], dead, "c", alive=lambda pid: False) == ["hamo-a"]
    with pytest.raises(AppExistsError, match="pid 1234 .* still running"):  # its job still runs
        leftovers(["hamo-a"], ["hamo-a"], dead, "c", alive=lambda pid: True)
    with pytest.raises(AppExistsError):  # recorded on another cluster: someone else's
        leftovers(["hamo-a"], ["hamo-a"], dead, "other", alive=lambda pid: False)
    with pytest.raises(AppExistsError):  # recorded on another host: cannot tell
        leftovers(["hamo-a"], ["hamo-a"], dead, "c", host="elsewhere", alive=lambda pid: False)


def test_claim_records_the_apps_and_release_drops_them(tmp_path):
    record = tmp_path / APPS_FILE
    assert claim_apps(["a", "a-harness"], record, "c", running=["b"]) == []
    mine = read_record(record)
    assert set(mine) == {"a", "a-harness"} and mine["a"]["pid"] == os.getpid() and mine["a"]["cluster"] == "c"
    with pytest.raises(AppExistsError):  # this job is alive: a second job on the folder is refused
        claim_apps(["a"], record, "c", running=["a"])
    release_apps(["a"], record)
    assert set(read_record(record)) == {"a-harness"}


class _FakeServe:
    """``ray.serve`` as far as Services.start and stop use it; records what was deployed and deleted."""

    def __init__(self, running):
        self.running, self.calls = dict.fromkeys(running, "RUNNING"), []

    def status(self):
        return types.SimpleNamespace(applications=dict(self.running))

    def __getattr__(self, name):  # start, run, delete, shutdown
        return lambda *a, **k: self.calls.append((name, a, k))


def test_services_refuse_before_deploying_anything_and_delete_nothing(tmp_path, monkeypatch):
    import ray

    import hamo_ray.serving.harness  # noqa: F401 (imported with the real Serve, before it is faked)

    cfg = load_config(None, [f"run.root={tmp_path}"])
    folder = RunFolder(tmp_path / "r", cfg)
    folder.prepare()
    fake = _FakeServe(["hamo-r"])  # another user's run with the same run id, say
    monkeypatch.setattr(ray, "serve", fake, raising=False)  # what `from ray import serve` finds
    monkeypatch.setattr("hamo_ray.run.serve_apps.cluster_id", lambda: "gcs:1")
    leases = []  # the cluster-wide lease (a Ray actor: tests/ray/test_app_lease.py) taken, then given back
    monkeypatch.setattr(
        "hamo_ray.run.serve_apps.lease_apps", lambda names, record: leases.append(("+", *names)) or names
    )
    monkeypatch.setattr("hamo_ray.run.serve_apps.unlease_apps", lambda names: leases.append(("-", *names)))
    services = Services(cfg, folder)
    assert services.app_names()[:3] == ("hamo-r", "/r", "hamo-r-harness")
    with pytest.raises(AppExistsError, match="'hamo-r'"):
        services.start("model")
    services.stop()  # what the stream's finally does
    assert fake.calls == []  # nothing started, deployed or deleted
    given = [x for x in leases if len(x) > 1]  # (stop() gives back the leases of the apps it deleted: none)
    assert given == [("+", "hamo-r-harness", "hamo-r"), ("-", "hamo-r-harness", "hamo-r")]
    assert not (folder.path / APPS_FILE).exists() or "hamo-r" not in read_record(folder.path / APPS_FILE)


def test_no_cluster_is_joined_unasked(monkeypatch, tmp_path):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "current").write_text("127.0.0.1:6380\n")  # another user's `ray start` on this machine
    monkeypatch.setattr(
        "ray._private.utils.get_ray_address_file", lambda temp_dir=None: str(tmp_path / "current")
    )
    assert cluster_address(RayConfig()) is None  # a private Ray
    assert cluster_address(RayConfig(address="auto")) == "auto"  # asked: that cluster
    assert cluster_address(RayConfig(address="127.0.0.1:6380")) == "127.0.0.1:6380"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6380")  # `ray job submit`: the job's own cluster
    assert cluster_address(RayConfig()) == "127.0.0.1:6380"
    assert cluster_address(RayConfig(address="local")) is None


def test_saved_configs_stay_valid(tmp_path):
    """Old run folders and the committed exports hold serve.app_name: hamo at route /: still valid (and
    serve.* may differ on resume); memory.table keeps its default, so the resume check sees no change."""
    cfg = load_config(None, ["serve.app_name=hamo", "serve.route_prefix=/"])
    assert (cfg.serve.app_name, cfg.serve.route_prefix) == ("hamo", "/")
    assert load_config(None, []).memory.table == "cards"
    assert naming.APP_PREFIX == "hamo"
