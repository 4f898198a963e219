"""Padding-free batches: examples packed into one row up to a token budget, attention kept per sequence.

A packed batch is one row of concatenated examples; ``position_ids`` restart at 0 for each example
and the attention function ``hamo_packed`` (registered with transformers' ``AttentionInterface``)
attends only inside each example, so a packed row computes exactly what the padded batch computes,
without the padding. Only the positions whose next token is labelled reach the LM head
(``Batch.hidden_index`` / ``Batch.targets``, computed here on the host), so the full
``tokens x vocabulary`` logits never exist and the step needs no host synchronisation::

    packs = pack_batches(lengths, token_budget=8192, seed=0, epoch=0)
    batch = collate([examples[i] for i in packs[0]], packed=True)
    logp = action_lm(**batch.model_inputs(device))   # log-probs of the labelled tokens

Attention: on CUDA, ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
``cu_seqlens``) when the installed torch has it, else one causal SDPA call per sequence (also the
CPU path); both are exact.
"""

from __future__ import annotations

import inspect
import logging
import random
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

ATTENTION = "hamo_packed"
_VARLEN: dict[str, Any] = {}  # the torch varlen function and how to call it, probed once


def pack_batches(
    lengths: list[int], token_budget: int, seed: int, epoch: int, pool_packs: int = 50
) -> list[list[int]]:
    """Shuffled packs of example indices, each at most ``token_budget`` tokens.

    Indices are shuffled, cut into pools, and each pool is packed first-fit-decreasing, so packs
    are nearly full; the packs are shuffled again. An example longer than the budget gets a pack
    of its own.

    Args:
        lengths: tokens per example.
        token_budget: the most tokens one pack holds.
        seed, epoch: the shuffle (a new order each epoch).
        pool_packs: about how many packs one pool fills (bigger pools pack tighter but mix less).

    Returns:
        Lists of indices into ``lengths``; every index appears exactly once.

    Raises:
        ValueError: a budget below 1.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    rng = random.Random(seed * 100_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    mean = max(1.0, sum(lengths) / max(1, len(lengths)))
    pool = max(1, int(pool_packs * token_budget / mean))
    packs: list[list[int]] = []
    for start in range(0, len(idx), pool):
        bins: list[list[int]] = []
        room: list[int] = []
        for i in sorted(idx[start : start + pool], key=lambda i: -lengths[i]):
            for b, free in enumerate(room):
                if lengths[i] <= free:
                    bins[b].append(i)
                    room[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                room.append(token_budget - lengths[i])
        packs += bins
    rng.shuffle(packs)
    return packs


AUTO_MEMORY_SHARE = 0.55  # of the device's memory, for the weights and one pack's saved activations
AUTO_MAX_TOKENS = 65_536
AUTO_MIN_STEPS = 8  # packs per epoch at least (the optimizer still takes steps on a small stage)


def device_pack_tokens(lm: Any, lengths: list[int], batch_size: int, device: Any) -> int:
    """The token budget of a pack for this device (``train.pack_tokens: auto``, the GPU default).

    On a GPU: what :data:`AUTO_MEMORY_SHARE` of its memory holds after the weights, at the
    activations one token keeps for the backward pass (``2 x layers x (12 hidden + 4 intermediate)``
    bytes in bf16, about 2.8 MiB on Qwen3-1.7B, which measured 48 GiB peak with 16,384-token packs;
    ``2 x layers x hidden`` under gradient checkpointing) rounded down to 1,024, at most
    :data:`AUTO_MAX_TOKENS` and an epoch's tokens / :data:`AUTO_MIN_STEPS`, never below the longest example.
    The smallest over the ranks (one collective), so every rank packs alike. Elsewhere (CPU):
    ``batch_size`` x the mean length, at least the longest example, as without ``auto``.
    """
    import math

    import torch

    longest = max(lengths, default=1)
    if torch.device(device).type != "cuda":
        mean = sum(lengths) / max(1, len(lengths))
        return max(longest, math.ceil(batch_size * mean))
    cfg = lm.model.config
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    inter = getattr(cfg, "intermediate_size", None) or 4 * hidden
    width = 2 if lm.spec.bf16 else 4
    per_token = width * layers * (2 * hidden if lm.spec.gradient_checkpointing else 12 * hidden + 4 * inter)
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    budget = int((AUTO_MEMORY_SHARE * total - weights) // per_token) // 1024 * 1024
    budget = max(longest, min(budget, AUTO_MAX_TOKENS, math.ceil(sum(lengths) / AUTO_MIN_STEPS)))
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor([budget], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        budget = int(t.item())
    logger.info("pack budget for %s: %d tokens", torch.cuda.get_device_name(torch.device(device)), budget)
    return budget


@dataclass
class Batch:
    """One micro-batch on the host, packed (one row) or padded (one row per example).

    ``hidden_index`` indexes the flattened ``[rows * columns]`` positions whose next token is
    labelled; ``targets`` holds those next tokens; ``segments`` says which example each belongs to.
    """

    input_ids: Any
    position_ids: Any
    attention_mask: Any
    hidden_index: Any
    targets: Any
    segments: Any
    seq_lens: list[int] | None  # packed: the example lengths; None when padded
    examples: int
    tokens: int  # real (non-padding) tokens
    positions: int  # positions computed (tokens + padding)

    def model_inputs(self, device: Any) -> dict[str, Any]:
        """The keyword arguments of :class:`hamo_ray.training.loop.ActionLM` on ``device``."""
        import torch

        nb = torch.device(device).type == "cuda"
        out = {
            "input_ids": self.input_ids.to(device, non_blocking=nb),
            "hidden_index": self.hidden_index.to(device, non_blocking=nb),
            "targets": self.targets.to(device, non_blocking=nb),
        }
        if self.seq_lens is not None:
            cu = torch.tensor([0, *_cumsum(self.seq_lens)], dtype=torch.int32)
            out["position_ids"] = self.position_ids.to(device, non_blocking=nb)
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu.to(device, non_blocking=nb)
            out["max_length_q"] = out["max_length_k"] = max(self.seq_lens)
            out["seq_lens"] = self.seq_lens
        else:
            out["attention_mask"] = self.attention_mask.to(device, non_blocking=nb)
        return out


def _cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def collate(examples: list[Any], packed: bool = True, pad_id: int = 0) -> Batch:
    """Build a :class:`Batch` from examples (``Example`` or dicts with ``input_ids`` and ``labels``).

    Args:
        examples: at least one example; ``labels`` is ``-100`` where no loss is taken.
        packed: one concatenated row (True) or a padded row per example (False).
        pad_id: the padding token (padded batches only).

    Returns:
        The batch, on the host.

    Raises:
        ValueError: no examples, or an example whose ``labels`` and ``input_ids`` differ in length.
    """
    import torch

    if not examples:
        raise ValueError("collate needs at least one example")
    rows = [(_field(e, "input_ids"), _field(e, "labels")) for e in examples]
    for n, (ids, labels) in enumerate(rows):
        if len(ids) != len(labels) or not ids:
            raise ValueError(f"example {n}: {len(ids)} input_ids but {len(labels)} labels")
    lengths = [len(ids) for ids, _ in rows]
    width = sum(lengths) if packed else max(lengths)
    hidden, targets, segments = [], [], []
    offset = 0
    for s, (ids, labels) in enumerate(rows):
        base = offset if packed else s * width
        for j in range(1, len(ids)):  # position j-1 predicts token j (the usual shift, per example)
            if labels[j] != -100:
                hidden.append(base + j - 1)
                targets.append(labels[j])
                segments.append(s)
        offset += len(ids)
    if packed:
        flat = [t for ids, _ in rows for t in ids]
        input_ids = torch.tensor([flat], dtype=torch.long)
        position_ids = torch.tensor([[p for n in lengths for p in range(n)]], dtype=torch.long)
        mask = None
    else:
        input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (ids, _) in enumerate(rows):
            input_ids[r, : len(ids)] = torch.tensor(ids)
            mask[r, : len(ids)] = 1
        position_ids = None
    return Batch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        hidden_index=torch.tensor(hidden, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        segments=torch.tensor(segments, dtype=torch.long),
        seq_lens=lengths if packed else None,
        examples=len(rows),
        tokens=sum(lengths),
        positions=width * (1 if packed else len(rows)),
    )


def _field(example: Any, name: str) -> list[int]:
    return example[name] if isinstance(example, dict) else getattr(example, name)


def packed_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, None]:
    """Attention inside each packed sequence: the ``hamo_packed`` transformers attention function.

    ``query``/``key``/``value`` are ``[1, heads, tokens, head_dim]``; the sequence boundaries come
    from ``cu_seq_lens_q`` (a device tensor) and ``seq_lens`` (the same lengths on the host).

    Returns:
        ``([1, tokens, heads, head_dim], None)``, as transformers' attention functions return.

    Raises:
        ValueError: called without the packed-batch keyword arguments.
    """
    import torch

    seq_lens = kwargs.get("seq_lens")
    groups = query.shape[1] // key.shape[1]
    # The kernel is probed once at model load (prepare_varlen), never here: a probe inside a
    # gradient-checkpointed forward would add tensors to the checkpoint and break its recomputation.
    fast = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not _VARLEN.get("off")
    if fast and _VARLEN.get("fn") is not None:
        fn, style = _VARLEN["fn"], _VARLEN["style"]
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
        if groups > 1 and not style["gqa"]:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu, longest = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
        extra: dict[str, Any] = {"scale": scaling} if style["scale"] else {}
        if style["gqa"] and groups > 1:
            extra["enable_gqa"] = True
        if style["causal"] == "is_causal":
            extra["is_causal"] = True
        else:
            extra["window_size"] = (-1, 0)
        out = fn(q, k, v, cu, cu, longest, longest, **extra)
        return out.unsqueeze(0), None
    if seq_lens is None:
        raise ValueError("hamo_packed attention needs the packed batch's seq_lens (use packing.collate)")
    outs, start = [], 0
    for n in seq_lens:  # exact per-sequence causal attention (CPU, or no varlen kernel)
        sl = slice(start, start + n)
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, sl],
                key[:, :, sl],
                value[:, :, sl],
                is_causal=True,
                scale=scaling,
                enable_gqa=groups > 1,
            )
        )
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def packed_on_device() -> bool:
    """True once :func:`prepare_varlen` found the varlen kernel usable (packed attention needs no host lengths)."""
    return _VARLEN.get("fn") is not None


def prepare_varlen() -> bool:
    """Probe torch's flash varlen attention on CUDA once (outside any forward); True when it will be used.

    Without it (no CUDA, an old torch, or a kernel that disagrees with SDPA), packed attention runs
    one causal SDPA call per sequence, which is exact but launches more kernels.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    with torch.enable_grad():
        return _varlen() is not None


def _varlen() -> Any:
    """torch's flash varlen attention and its calling convention, or None where it is missing."""
    if "fn" not in _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn

            params = inspect.signature(varlen_attn).parameters
            _VARLEN["fn"] = varlen_attn
            _VARLEN["style"] = {
                "causal": "is_causal" if "is_causal" in params else "window_size",
                "gqa": "enable_gqa" in params,
                "scale": "scale" in params,
            }
            if "is_causal" not in params and "window_size" not in params:
                raise ImportError("varlen_attn takes neither is_causal nor window_size")
            _probe_varlen()
        except Exception as e:  # missing, or wrong here: the exact per-sequence path instead
            logger.warning("torch varlen attention unusable (%s): per-sequence SDPA", e)
            _VARLEN["fn"] = None
    return _VARLEN["fn"]


def _probe_varlen() -> None:
    """Run the varlen kernel once, forward and backward, against per-sequence SDPA (raises on a mismatch)."""
    import torch

    torch.manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 40, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)
    )
    kwargs = {
        "seq_lens": [15, 25],
        "cu_seq_lens_q": torch.tensor([0, 15, 40], device="cuda", dtype=torch.int32),
    }
    kwargs["max_length_q"] = 25
    fast = packed_attention(None, q, k, v, None, scaling=0.125, **kwargs)[0]
    fast.float().square().sum().backward()
    grad = q.grad.clone()
    q.grad = None
    _VARLEN["off"] = True
    try:
        slow = packed_attention(None, q, k, v, None, scaling=0.125, **kwargs)[0]
        slow.float().square().sum().backward()
    finally:
        _VARLEN.pop("off")
    err = float((fast - slow).abs().max()) + float((grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-6))
    if not err < 5e-2:
        raise RuntimeError(f"varlen attention differs from per-sequence SDPA by {err:.3g}")


def register_attention() -> str:
    """Register ``hamo_packed`` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, packed_attention)
    return ATTENTION
