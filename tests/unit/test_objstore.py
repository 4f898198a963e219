"""Adapter stores behind a URI: a ``file://`` folder and a real S3 protocol server (moto), same tests.

Two ``AdapterRegistry`` instances with separate caches play two replicas on two nodes: what one
loads and registers, the other finds in the store's registry and downloads for itself.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from hamo_ray.serving.adapters import REGISTRY_FILE, AdapterError, AdapterRegistry
from hamo_ray.serving.objstore import CACHE_ENV, ObjectStore, ObjectStoreError, default_cache, is_uri


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture(params=["file", "s3"])
def store_uri(request, tmp_path, monkeypatch) -> str:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    if request.param == "file":
        return f"file://{tmp_path / 'bucket' / 'adapters'}"
    endpoint = request.getfixturevalue("s3_server")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    bucket = f"b-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    query = f"endpoint_override={endpoint}&scheme=http&region=us-east-1"
    ObjectStore(f"s3://{bucket}?{query}&allow_bucket_creation=true").fs.create_dir(bucket)
    return f"s3://{bucket}/run-7/adapters?{query}"


def _adapter(path: Path, rank: int = 8, weights: bytes = b"\x00" * 64) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    (path / "sub").mkdir()
    (path / "sub" / "note.txt").write_text("nested files travel too")
    return path


def test_upload_fetch_and_cache(store_uri, tmp_path):
    assert is_uri(store_uri) and not is_uri(tmp_path) and not is_uri(None)
    store = ObjectStore(store_uri)
    local = _adapter(tmp_path / "run" / "stage-1", weights=b"\x01\x02" * 1000)
    assert not store.exists("stage-1")
    store.upload(local, "stage-1")
    assert store.exists("stage-1")
    got = store.fetch("stage-1", tmp_path / "c1")
    assert got == tmp_path / "c1" / "stage-1"
    assert (got / "adapter_model.safetensors").read_bytes() == b"\x01\x02" * 1000
    assert (got / "sub" / "note.txt").read_text() == "nested files travel too"
    assert not [p for p in got.parent.iterdir() if p.name.startswith(".")]  # no download leftovers
    (got / "sub" / "note.txt").write_text("touched")  # an unchanged store: the cached copy is reused
    assert (store.fetch("stage-1", tmp_path / "c1") / "sub" / "note.txt").read_text() == "touched"
    assert store.put(local, "stage-1") is False  # same files: nothing uploaded


def test_a_redone_stage_is_never_served_stale(store_uri, tmp_path):
    """Crash after publishing stage-2, redo it (same folder name, new weights): the store and every
    replica's cache move to the new weights."""
    store = ObjectStore(store_uri)
    first = _adapter(tmp_path / "attempt-1" / "stage-2", weights=b"old" * 100)
    assert store.put(first, "stage-2") is True
    assert (store.fetch("stage-2", tmp_path / "c") / "adapter_model.safetensors").read_bytes() == b"old" * 100
    redone = _adapter(tmp_path / "attempt-2" / "stage-2", weights=b"new" * 100)
    assert store.put(redone, "stage-2") is True
    got = store.fetch("stage-2", tmp_path / "c")
    assert (got / "adapter_model.safetensors").read_bytes() == b"new" * 100
    assert not [p for p in got.parent.iterdir() if p.name.startswith(".")]  # the stale copy is gone
    assert store.read_text("missing.json") is None
    store.write_text("x/notes.json", '{"a": 1}')
    assert json.loads(store.read_text("x/notes.json")) == {"a": 1}


def test_bad_paths_and_incomplete_folders(store_uri, tmp_path):
    store = ObjectStore(store_uri)
    for bad in ("", "/etc", "../other-run/stage-1", "a/../../b"):
        with pytest.raises(ObjectStoreError, match="relative path"):
            store.fetch(bad, tmp_path / "c")
    with pytest.raises(ObjectStoreError, match="no adapter at .*stage-9"):
        store.fetch("stage-9", tmp_path / "c")
    store.write_text("half/adapter_model.safetensors", "upload cut before its config")
    with pytest.raises(ObjectStoreError, match="no adapter_config.json"):
        store.fetch("half", tmp_path / "c")
    (tmp_path / "not-adapter").mkdir()
    with pytest.raises(ObjectStoreError, match="not a peft adapter"):
        store.upload(tmp_path / "not-adapter", "x")
    with pytest.raises(ObjectStoreError, match="cannot open adapter store"):
        ObjectStore("nosuchscheme://bucket/x")


def test_two_replicas_share_names_through_the_store(store_uri, tmp_path, monkeypatch):
    store = ObjectStore(store_uri)
    store.upload(_adapter(tmp_path / "run" / "stage-1"), "stage-1")
    store.upload(_adapter(tmp_path / "run" / "stage-2"), "stage-2")
    store.upload(_adapter(tmp_path / "run" / "big", rank=64), "big")
    first = AdapterRegistry(store_uri, {"base"}, max_lora_rank=16)
    assert first.root == default_cache(store_uri).resolve()
    resolved, known = first.check("stage-1", "stage-1")
    assert not known and resolved == first.root / "stage-1" and (resolved / "adapter_config.json").is_file()
    first.add("stage-1", resolved)
    assert json.loads(store.read_text(REGISTRY_FILE)) == {"stage-1": "stage-1"}  # store paths, not caches
    for name, path, status in [
        ("s9", "stage-9", 400),  # not in the store
        ("s2", "/tmp/stage-1", 400),  # absolute: not a store path
        ("s3", "../stage-1", 400),
        ("big", "big", 400),  # rank 64 > 16
        ("stage-1", "stage-2", 409),  # the name serves other weights
    ]:
        with pytest.raises(AdapterError) as err:
            first.check(name, path)
        assert err.value.status == status, (name, path, err.value.message)

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "other-node-cache"))  # a replica on another node
    second = AdapterRegistry(store_uri, {"base"}, max_lora_rank=16)
    assert second.root != first.root
    [(name, path)] = second.sync()
    assert name == "stage-1" and path == second.root / "stage-1" and (path / "adapter_config.json").is_file()
