"""Shared test setup: offline hub, quiet logs, GPU tests skipped without CUDA, a tiny Qwen3 model folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A developer's exported keys would change every test stream (hamo_ray/config/secrets.py reads them).
for _var in [
    v for v in os.environ if v.startswith(("HAMO_API_KEY", "HAMO_LLM_API_KEY", "HAMO_STORAGE_OPTIONS"))
]:
    del os.environ[_var]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    for item in items:
        if "tests/gpu" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


QWEN3_TEMPLATE = Path(__file__).parent / "assets" / "qwen3_chat_template.jinja"
# Qwen3's own special and added tokens; <think>/</think> are plain added tokens there, as here.
QWEN3_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def build_qwen3_folder(path: Path) -> Path:
    """A tiny random Qwen3ForCausalLM + byte-level BPE tokenizer with Qwen3's tokens and official template.

    Stands in for a Qwen3 checkpoint (which cannot be downloaded here): same architecture class,
    same special tokens (eos ``<|im_end|>``, pad ``<|endoftext|>``), same chat template with its
    ``enable_thinking`` switch, so rendering, training and serving code see what a real Qwen3 gives.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hamo_ray.backbones.tiny_lm import init_qwen3, save_backbone
    from hamo_ray.config import BackboneConfig

    corpus = [
        "Your task is to focus on the animal. This room is called the kitchen. You see a table.",
        "open door to hallway. go to hallway. look around. pick up thermometer. focus on orange.",
        "You are in the middle of a room. Your task is to: put a clean mug in coffeemachine.",
        "go to countertop 1. take mug 1 from countertop 1. clean mug 1 with sinkbasin 1.",
        "search[red shoes size 9] click[b0123] click[buy now] Thought: I should look first. Action:",
    ] * 40
    try:  # the domain prompts make token counts of rendered prompts closer to a real vocabulary's
        from hamo_ray.envs.prompts import DOMAIN_PROMPTS

        corpus += [p.system for p in DOMAIN_PROMPTS.values()] * 20
    except ImportError:
        pass
    # Qwen2/3's byte-level BPE: NFC, its split regex (newline runs are one piece), byte-level bytes.
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=QWEN3_TOKENS[:3],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.add_tokens(QWEN3_TOKENS[3:])  # Qwen3: <think> and </think> are added tokens, not special ones
    tok.chat_template = QWEN3_TEMPLATE.read_text()
    model = init_qwen3(BackboneConfig(vocab_size=1024), tok, max_position_embeddings=4096)
    return save_backbone(model, tok, path)


@pytest.fixture(scope="session")
def qwen3_folder(tmp_path_factory) -> Path:
    """Path of a tiny Qwen3 model folder carrying Qwen3's official chat template (see ``build_qwen3_folder``)."""
    return build_qwen3_folder(tmp_path_factory.mktemp("qwen3") / "model")
