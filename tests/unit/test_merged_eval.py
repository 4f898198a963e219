"""Acting on merged weights (``serve.eval_weights``, ``hamo_ray.serving.merged``) without Ray or vLLM: the
setting, the engine arguments, the merge (a tiny random Llama), its keying by content, the engine's
statement of which weights it holds, and ``Services.acting``'s choice of endpoint."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hamo_ray.config import load_config
from hamo_ray.naming import merged_app_names, merged_names
from hamo_ray.run.folder import RunFolder
from hamo_ray.run.services import Endpoint, Services
from hamo_ray.serving import merged as M
from hamo_ray.serving import merged_app as MA
from hamo_ray.serving.adapters import AdapterError, AdapterRegistry
from hamo_ray.serving.engine import engine_kwargs
from hamo_ray.serving.objstore import folder_digest


def test_the_setting_resolves_by_device():
    assert M.resolve_eval_weights("auto", gpus=False) == "merged"
    assert M.resolve_eval_weights("auto", gpus=True) == "adapter"  # a second engine would double GPU memory
    assert M.resolve_eval_weights("merged", gpus=True) == "merged"
    assert M.resolve_eval_weights("adapter", gpus=False) == "adapter"
    with pytest.raises(ValueError, match="eval_weights"):
        M.resolve_eval_weights("fast", gpus=False)
    assert load_config(None).serve.eval_weights == "adapter"  # the engine start pays only on long evaluations
    with pytest.raises(Exception, match="eval_weights"):
        load_config(None, ["serve.eval_weights=fast"])


def test_an_engine_without_lora_drops_every_lora_argument():
    cfg = load_config(None, ["serve.engine_kwargs={max_cpu_loras: 4, enforce_eager: true}"])
    with_lora = engine_kwargs("/m", cfg.model, cfg.serve, device="cpu")
    assert with_lora["enable_lora"] and with_lora["max_loras"] == cfg.serve.max_loras
    plain = engine_kwargs("/m", cfg.model, cfg.serve, device="cpu", lora=False)
    assert not set(plain) & set(M_LORA := ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"))
    assert plain["enforce_eager"] is True and plain["model"] == "/m"
    assert {k: v for k, v in with_lora.items() if k not in M_LORA} == plain


# -- the merge ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 2-layer Llama folder and two different LoRA adapters (r4, every projection) on it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(root / "base")
    (root / "base" / "tokenizer_config.json").write_text("{}")  # copied into the merged folder
    adapters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"])  # fmt: skip
        peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"), lora)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)  # B is zero at init: make the adapter change things
        out = root / "adapters" / f"stage-{seed}"
        peft_model.save_pretrained(out)
        adapters.append(out)
    return root / "base", adapters


def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_merged_weights_answer_as_the_adapter(tiny, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, (adapter, _) = tiny
    out = M.merge_adapter(base, adapter, tmp_path)
    ids = [1, 5, 9, 13, 2, 40]
    merged = _logits(AutoModelForCausalLM.from_pretrained(out), ids)
    lora = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter), ids)
    plain = _logits(AutoModelForCausalLM.from_pretrained(base), ids)
    assert torch.allclose(merged, lora, atol=1e-5)
    assert not torch.allclose(merged, plain, atol=1e-3)  # the adapter does change the answers
    marker = M.read_marker(out)
    assert marker["adapter_digest"] == folder_digest(adapter) and marker["base"] == M.base_fingerprint(base)
    assert (out / "tokenizer_config.json").is_file() and not list(out.glob("adapter_*"))


def test_merged_folders_are_keyed_by_the_adapters_content(tiny, tmp_path):
    base, (first, second) = tiny
    a = M.merge_adapter(base, first, tmp_path)
    weights = a / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert M.merge_adapter(base, first, tmp_path) == a and weights.stat().st_mtime_ns == stamp  # reused
    b = M.merge_adapter(base, second, tmp_path)
    assert b != a and M.is_current(b, folder_digest(second), M.base_fingerprint(base))
    assert not M.is_current(a, folder_digest(second), M.base_fingerprint(base))
    # A marker that names other weights (a half-written or stale folder) is merged again, not reused.
    (a / M.MARKER).write_text(json.dumps({"adapter_digest": "0" * 64, "base": "x"}))
    assert M.merge_adapter(base, first, tmp_path) == a and weights.stat().st_mtime_ns != stamp
    assert M.is_current(a, folder_digest(first), M.base_fingerprint(base))
    # keep=1: only the newest merge stays.
    M.merge_adapter(base, second, tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [b.name]


def test_an_apps_slot_is_one_path_whose_marker_names_the_weights(tiny, tmp_path):
    base, (first, second) = tiny
    a = M.merge_adapter(base, first, tmp_path, slot="hamo-r-merged")
    assert a.name == "slot-hamo-r-merged" and M.is_current(a, folder_digest(first), M.base_fingerprint(base))
    b = M.merge_adapter(base, second, tmp_path, slot="hamo-r-merged")  # the next stage: same path
    assert b == a and M.is_current(b, folder_digest(second), M.base_fingerprint(base))
    assert not M.is_current(b, folder_digest(first), M.base_fingerprint(base))
    M.merge_adapter(base, first, tmp_path, keep=1)  # pruning leaves the apps' slots alone
    assert a.is_dir()


def test_a_replica_merges_only_the_weights_its_name_names(tiny, tmp_path, monkeypatch):
    base, (first, second) = tiny
    monkeypatch.setenv("HAMO_MERGED_CACHE", str(tmp_path / "cache"))
    registry = AdapterRegistry(first.parent, set(), 16)
    name = f"stage-1:{folder_digest(first)[:12]}"
    out = M.prepare_merged(registry, base, name=name, path=str(first))  # no Ray: merged in-process
    assert M.read_marker(out)["adapter_digest"] == folder_digest(first)
    # The folder rewritten after publishing (a redone stage): the old name is refused, never merged stale.
    with pytest.raises(AdapterError, match="other files"):
        M.prepare_merged(registry, base, name=f"stage-1:{folder_digest(second)[:12]}", path=str(first))


# -- which weights an engine states --------------------------------------------------------------


class _Resp:
    def __init__(self, status, body):
        self.status_code, self._body = status, body

    def json(self):
        return self._body


def _serving(monkeypatch, model, ids, status=200):
    def get(url, **kw):
        if url.endswith("/health"):
            return _Resp(status, {"status": "ok", "model": model})
        return _Resp(200, {"data": [{"id": i} for i in ids]})

    monkeypatch.setattr(MA.httpx, "get", get)


def test_the_engine_must_state_the_adapters_name(monkeypatch):
    _serving(monkeypatch, "stage-2:aaaaaaaaaaaa", ["stage-2:aaaaaaaaaaaa"])
    MA.check_serves("http://m", "stage-2:aaaaaaaaaaaa")
    with pytest.raises(M.MergedWeightsError, match="stale"):  # the first attempt's weights
        MA.check_serves("http://m", "stage-2:bbbbbbbbbbbb")
    _serving(monkeypatch, "stage-2:aaaaaaaaaaaa", ["stage-2:aaaaaaaaaaaa", "base"])  # a LoRA endpoint
    with pytest.raises(M.MergedWeightsError):
        MA.check_serves("http://m", "stage-2:aaaaaaaaaaaa")
    _serving(monkeypatch, "stage-2:aaaaaaaaaaaa", ["stage-2:aaaaaaaaaaaa"], status=503)
    with pytest.raises(M.MergedWeightsError, match="503"):
        MA.check_serves("http://m", "stage-2:aaaaaaaaaaaa")


def test_the_merged_app_is_redeployed_for_other_weights(monkeypatch):
    deployed, states = [], {}
    app = MA.MergedApp("/base", None, SimpleNamespace(api_key=None), "/adapters", 16)

    def deploy(name, path):
        deployed.append(name)
        app.url, app.serving, app.direct = "http://m", name, "http://direct"
        states["serves"] = name

    def check(url, name, **kw):
        if states.get("serves") != name:
            raise M.MergedWeightsError("stale")

    monkeypatch.setattr(app, "deploy", deploy)
    monkeypatch.setattr(MA, "check_serves", check)
    assert app.ensure("stage-1:a", "p1") == ("http://m", "http://direct")
    app.ensure("stage-1:a", "p1")  # still serving it: no new engine
    app.ensure("stage-2:b", "p2")
    assert deployed == ["stage-1:a", "stage-2:b"]
    states["serves"] = "something else"  # a replica replaced by someone else's deployment
    app.ensure("stage-2:b", "p2")
    assert deployed == ["stage-1:a", "stage-2:b", "stage-2:b"]


def test_merged_app_names():
    assert merged_app_names("hamo-r", "/r") == ("hamo-r-merged", "/r/merged")
    assert merged_app_names("hamo", "/") == ("hamo-merged", "/merged")


# -- Services.acting ------------------------------------------------------------------------------


def _services(tmp_path, *overrides, shared=None):
    cfg = load_config(None, [f"run.root={tmp_path}", *overrides])
    folder = RunFolder(tmp_path / "r", cfg)
    folder.prepare()
    services = Services(cfg, folder, shared_url=shared, run_id="cell-a" if shared else "")
    services.endpoint = Endpoint("http://h:1/r", "http://h:1/r/harness", None, "/base", "http://h:2")
    services._model_path = "/base"
    return services


class _FakeMerged:
    def __init__(self, fail=False, swap=False):
        self.fail, self.ensured, self.stopped, self.swap = fail, [], 0, swap

    def ensure(self, name, path):
        if self.fail:
            raise M.MergedWeightsError("engine did not come up")
        self.ensured.append((name, path))
        return "http://h:1/r/merged", "http://h:3"

    def stop(self):
        self.stopped += 1


def test_acting_picks_merged_weights_only_for_a_published_adapter(tmp_path, monkeypatch):
    monkeypatch.setattr(MA, "probe_agreement", lambda *a, **k: {"agree": True})
    services = _services(tmp_path, "serve.eval_weights=merged", "serve.merged_swap=false")
    services._merged = fake = _FakeMerged()
    assert services.acting(None) is services.endpoint  # the base model (no engine kept for it)
    assert services.acting("stage-1:abc") is services.endpoint  # not published by this run
    services.published["stage-1:abc"] = "/adapters/stage-1"
    got = services.acting("stage-1:abc")
    assert (got.base_url, got.direct_url) == ("http://h:1/r/merged", "http://h:3")
    assert got.harness_url == services.endpoint.harness_url and got.tokenizer == "/base"
    assert fake.ensured == [("stage-1:abc", "/adapters/stage-1")]
    assert got.spec("stage-1:abc", services.cfg, seed=0).model == "stage-1:abc"  # episodes record the name
    services.stop_acting()
    assert fake.stopped == 1
    lora = _services(tmp_path / "b", "serve.eval_weights=adapter")
    lora.published["stage-1:abc"] = "/adapters/stage-1"
    assert lora.acting("stage-1:abc") is lora.endpoint


def test_a_swapping_merged_app_also_plays_the_base_and_stays_up_between_stages(tmp_path, monkeypatch):
    monkeypatch.setattr(MA, "probe_agreement", lambda *a, **k: {"agree": True})
    services = _services(tmp_path, "serve.eval_weights=merged", "serve.merged_swap=true")
    assert not _services(tmp_path / "d").cfg.serve.merged_swap  # off by default
    services._merged = fake = _FakeMerged(swap=True)
    assert services.acting(None).base_url == "http://h:1/r/merged"  # the base weights, on the fast engine
    assert services.acting("stage-1:abc") is services.endpoint  # not published by this run
    services.published["stage-1:abc"] = "/adapters/stage-1"
    assert services.acting("stage-1:abc").base_url == "http://h:1/r/merged"
    assert fake.ensured == [(None, None), ("stage-1:abc", "/adapters/stage-1")]
    services.stop_acting()  # after the evaluation: kept for the next stage
    assert fake.stopped == 0
    services.stop_acting(force=True)
    assert fake.stopped == 1


def test_acting_falls_back_to_lora_when_merged_weights_fail_or_disagree(tmp_path, monkeypatch):
    services = _services(tmp_path, "serve.eval_weights=merged")
    services.published["stage-1:abc"] = "/adapters/stage-1"
    services._merged = fake = _FakeMerged(fail=True)
    assert services.acting("stage-1:abc") is services.endpoint and fake.stopped == 1
    services._merged = fake = _FakeMerged()
    monkeypatch.setattr(MA, "probe_agreement", lambda *a, **k: {"agree": False})
    assert services.acting("stage-1:abc") is services.endpoint and fake.stopped == 1


def test_merged_app_names_of_a_run_and_of_a_sweep_cell(tmp_path):
    assert merged_names(*_services(tmp_path).app_names()) == ("hamo-r-merged", "/r/merged")
    cell = _services(tmp_path / "c", shared="http://h:1/sweep/0")
    app, route = merged_names(*cell.app_names())
    assert app.endswith("-merged-cell-a") and route == "/sweep/0/merged-cell-a"


def test_a_following_server_retries_an_adapter_not_proven_live_with_backoff(tmp_path, monkeypatch):
    """publish_committed(strict=False): a stage whose adapter failed is tried again later (not given up
    forever), after 30 s, then 60 s, ...; once live it is served and forgotten by the retry book."""
    from hamo_ray.serving import AdapterNotLiveError
    from hamo_ray.types import StageResult

    services = _services(tmp_path)
    result = StageResult(stage=1, method="hamo", domain="scienceworld", num_trajectories=1, num_cards=1,
                         budget=1, anchors=[], replay=[], adapter="adapters/stage-1", adapter_name="stage-1:aaaaaaaaaaaa",
                         train_loss=1.0, scores={"scienceworld": 1.0}, seconds={})  # fmt: skip
    monkeypatch.setattr(services.folder, "stages", lambda: [result])
    clock = {"t": 1000.0}
    monkeypatch.setattr("hamo_ray.run.services.time.monotonic", lambda: clock["t"])
    calls = []

    def publish(name, path):
        calls.append(clock["t"])
        if len(calls) < 3:
            raise AdapterNotLiveError("replica not ready")
        return {"status": "loaded"}

    monkeypatch.setattr(services, "publish", publish)
    assert services.publish_committed(strict=False) == [] and services.failed[1][0] == 1
    clock["t"] += 29
    assert services.publish_committed(strict=False) == [] and len(calls) == 1  # waits 30 s
    clock["t"] += 1
    assert services.publish_committed(strict=False) == [] and services.failed[1][0] == 2
    clock["t"] += 59
    services.publish_committed(strict=False)
    assert len(calls) == 2  # then 60 s
    clock["t"] += 1
    assert services.publish_committed(strict=False) == ["stage-1:aaaaaaaaaaaa"]
    assert services.served == {1: "stage-1:aaaaaaaaaaaa"} and services.failed == {}
    with pytest.raises(AdapterNotLiveError):  # strict (the stream): the first failure raises
        calls.clear()
        fresh = _services(tmp_path / "s")
        monkeypatch.setattr(fresh.folder, "stages", lambda: [result])
        monkeypatch.setattr(fresh, "publish", publish)
        fresh.publish_committed(strict=True)


def test_slots_of_other_apps_untouched_for_a_day_are_pruned(tmp_path):
    import os
    import time

    old, fresh, current = (tmp_path / f"slot-{n}" for n in ("old", "fresh", "current"))
    for folder in (old, fresh, current):
        folder.mkdir()
        (folder / M.MARKER).write_text("{}")
    day_ago = time.time() - M.SLOT_MAX_AGE_S - 60
    os.utime(old, (day_ago, day_ago))
    os.utime(current, (day_ago, day_ago))
    M._prune(tmp_path, 2, current)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot-current", "slot-fresh"]


def test_a_killed_attempts_merged_app_is_deleted_when_the_run_starts_again(tmp_path, monkeypatch):
    """A cell killed during a merged evaluation leaves its merged app (2 CPUs held); the resumed cell may
    not act on merged weights again, so its start deletes it (and only apps of dead jobs of this folder)."""
    import os
    import socket

    from ray import serve

    from hamo_ray.naming import read_record, write_record
    from hamo_ray.run import serve_apps as S

    record_file = tmp_path / S.APPS_FILE
    dead = {"cluster": "c1", "host": socket.gethostname(), "pid": 2**22 + 12345, "since": 0.0}
    live = {**dead, "pid": os.getpid()}
    write_record(record_file, {"r-merged": dead, "r-other": live, "r-gone": dead, "r": dead})
    monkeypatch.setattr(S, "cluster_id", lambda: "c1")
    deleted = []
    monkeypatch.setattr(serve, "delete", deleted.append)
    S.delete_leftovers(record_file, {"r"}, ["r", "r-merged", "r-other"])
    assert deleted == ["r-merged"]  # r-other: a live job's; r-gone: not running; r: redeployed now
    assert sorted(read_record(record_file)) == ["r", "r-other"]
