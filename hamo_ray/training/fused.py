"""Fused training kernels in plain torch: the LoRA linear, RMSNorm and the action-token loss.

The frozen-base LoRA step is memory-bound outside its matmuls. peft's ``lora.Linear`` computes
``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the three matmuls, a scaling pass and an
addition over the ``tokens x out_features`` output, each read and written again in the backward pass.
:func:`fuse_lora` gives each LoRA linear one autograd function instead: the low-rank product is
added into the base output by the matmul itself (``addmm`` with ``alpha=scaling``), and in the
backward the input gradient of both paths comes out of one ``mm`` + ``addmm``; the LoRA weights and
gradients are unchanged (same parameters, same peft state dict). :func:`fuse_rms_norm` runs the
models' RMSNorm as ``torch.rms_norm`` (one fused kernel on CUDA instead of six elementwise passes).
:class:`ChunkedLogProbs` is the loss's head: the log-probabilities of the labelled tokens from their
hidden states, chunk by chunk, the logits recomputed in the backward pass instead of kept.

All three compute the same function as the modules they replace (tested against them on CPU in
float64, ``tests/unit/test_fused.py``); ``ModelSpec.fused`` turns them on (``train.fused``: by
default on GPU only, so the CPU path stays bit-for-bit what it was)::

    fuse_lora(peft_model); fuse_rms_norm(peft_model)
    logp = ChunkedLogProbs.apply(hidden_rows, lm_head.weight, targets)
"""

from __future__ import annotations

import logging
import types
from typing import Any

logger = logging.getLogger(__name__)

# RMSNorm classes whose forward is x * rsqrt(mean(x^2) + eps) * weight in the input's dtype (not Gemma's 1 + w)
RMS_NORMS = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen3MoeRMSNorm"})
# labelled rows per chunk of the loss: 2,048 x a 151,936 vocabulary = 1.2 GiB of float32 logits
LOSS_CHUNK = 2048


def _lora_fn():
    import torch

    class LoraLinearFn(torch.autograd.Function):
        """``x W^T + b + scaling * (x A^T) B^T`` with the low-rank term added inside the matmuls."""

        @staticmethod
        def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            h = x2 @ lora_a.t()  # [tokens, r]
            y = torch.nn.functional.linear(x2, weight, bias)
            y.addmm_(h, lora_b.t(), alpha=scaling)
            ctx.save_for_backward(x2, h, weight, lora_a, lora_b)
            ctx.scaling, ctx.shape = scaling, shape
            return y.view(*shape[:-1], y.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            x2, h, weight, lora_a, lora_b = ctx.saved_tensors
            s, need = ctx.scaling, ctx.needs_input_grad
            g2 = grad.reshape(-1, grad.shape[-1])
            gh = (g2 @ lora_b).mul_(s)  # [tokens, r]: the gradient of x A^T
            gx = gw = gbias = ga = gb = None
            if need[0]:
                gx = torch.addmm(g2 @ weight, gh, lora_a).view(ctx.shape)
            if need[1]:
                gw = g2.t() @ x2
            if need[2]:
                gbias = g2.sum(0)
            if need[3]:
                ga = gh.t() @ x2
            if need[4]:
                gb = (g2.t() @ h).mul_(s)
            return gx, gw, gbias, ga, gb, None

    return LoraLinearFn


_FN: dict[str, Any] = {}


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float):
    """``linear(x, weight, bias) + scaling * linear(linear(x, lora_a), lora_b)`` as one autograd node."""
    if "lora" not in _FN:
        _FN["lora"] = _lora_fn()
    return _FN["lora"].apply(x, weight, bias, lora_a, lora_b, scaling)


def _fused_lora_forward(self, x, *args, **kwargs):
    """A peft ``lora.Linear`` forward: fused when it is plain LoRA on one adapter, else peft's own."""
    import torch

    adapter = self.active_adapters[0] if len(self.active_adapters) == 1 else None
    base = self.base_layer
    if (
        args
        or kwargs
        or adapter is None
        or self.disable_adapters
        or self.merged
        or adapter not in self.lora_A
        or adapter in getattr(self, "lora_variant", {})
        or not isinstance(base, torch.nn.Linear)
        or not isinstance(self.lora_dropout[adapter], torch.nn.Identity)
        or self.lora_B[adapter].bias is not None  # peft's lora_bias
        or x.dtype != base.weight.dtype
        or x.dtype != self.lora_A[adapter].weight.dtype
    ):
        return type(self).forward(self, x, *args, **kwargs)
    return lora_linear(
        x,
        base.weight,
        base.bias,
        self.lora_A[adapter].weight,
        self.lora_B[adapter].weight,
        float(self.scaling[adapter]),
    )


def fuse_lora(model: Any) -> int:
    """Give every peft LoRA ``Linear`` of ``model`` the fused forward (in place); the count patched.

    The parameters, their names and peft's saving are untouched; modules with dropout, DoRA, a LoRA
    bias, several active adapters or a merged adapter keep peft's forward at call time. Not for DeepSpeed ZeRO-3, whose
    parameter gathering hooks on the sub-modules that this forward does not call.
    """
    from peft.tuners.lora.layer import Linear

    n = 0
    for module in model.modules():
        if type(module) is Linear:  # subclasses (bnb, torchao...) keep theirs
            module.forward = types.MethodType(_fused_lora_forward, module)
            n += 1
    return n


def _rms_forward(self, x):
    import torch

    w = self.weight
    if x.dtype != w.dtype:
        return type(self).forward(self, x)
    return torch.rms_norm(x, (x.shape[-1],), w, self.variance_epsilon)


def fuse_rms_norm(model: Any) -> int:
    """Run the known RMSNorm modules of ``model`` (``RMS_NORMS``) as ``torch.rms_norm``; the count patched."""
    n = 0
    for module in model.modules():
        if type(module).__name__ in RMS_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_forward, module)
            n += 1
    return n


def unfuse(model: Any) -> None:
    """Undo :func:`fuse_lora` and :func:`fuse_rms_norm` (the class forwards again)."""
    for module in model.modules():
        if getattr(vars(module).get("forward"), "__func__", None) in (_fused_lora_forward, _rms_forward):
            del module.forward


def _logprob_fn():
    import torch

    class ChunkedLogProbs(torch.autograd.Function):
        """log softmax(hidden @ weight^T)[targets] per row, float32, in chunks of ``LOSS_CHUNK`` rows.

        Forward keeps per row only the log-sum-exp; backward recomputes each chunk's logits and
        applies ``(onehot - softmax) * grad`` to get the hidden states' (and, when it is trained,
        the head's) gradient. Peak memory: one chunk of float32 logits, not all of them.
        """

        @staticmethod
        def forward(ctx, hidden, weight, targets, chunk: int = LOSS_CHUNK):
            n = hidden.shape[0]
            out = torch.empty(n, dtype=torch.float32, device=hidden.device)
            lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
            for s in range(0, n, chunk):
                logits = (hidden[s : s + chunk] @ weight.t()).float()
                lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
                out[s : s + chunk] = logits.gather(1, targets[s : s + chunk, None]).squeeze(1)
            ctx.save_for_backward(hidden, weight, targets, lse)
            ctx.chunk = chunk
            return out.sub_(lse)

        @staticmethod
        def backward(ctx, grad):
            hidden, weight, targets, lse = ctx.saved_tensors
            need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            gh = torch.empty_like(hidden) if need_h else None
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            for s in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[s : s + ctx.chunk]
                logits = (h @ weight.t()).float()
                g = torch.exp(logits.sub_(lse[s : s + ctx.chunk, None]))  # softmax
                g.neg_().scatter_add_(1, targets[s : s + ctx.chunk, None], torch.ones_like(g[:, :1]))
                g.mul_(grad[s : s + ctx.chunk, None])  # d logp / d logits, times the incoming gradient
                g = g.to(hidden.dtype)
                if need_h:
                    gh[s : s + ctx.chunk] = g @ weight
                if need_w:
                    gw.addmm_(g.t().float(), h.float())
            return gh, (gw.to(weight.dtype) if need_w else None), None, None

    return ChunkedLogProbs


def chunked_logprobs(hidden, weight, targets, chunk: int = LOSS_CHUNK):
    """Float32 log-probabilities of ``targets`` under ``hidden @ weight^T``, the logits never all kept."""
    if "logp" not in _FN:
        _FN["logp"] = _logprob_fn()
    return _FN["logp"].apply(hidden, weight, targets, chunk)
