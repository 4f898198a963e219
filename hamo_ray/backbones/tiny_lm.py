"""The parts of the embedded default backbone: a byte-level BPE tokenizer and a tiny Qwen3 LM.

Both are saved in Hugging Face format, so everything downstream (peft, vLLM, the trainer) loads them
through the same ``from_pretrained`` code as any hub model::

    tok = train_tokenizer(texts, vocab_size=2048)
    model = init_qwen3(cfg, tok)
    save_backbone(model, tok, "/path/to/backbone")

Training the backbone on held-out expert data is ``hamo_ray.backbones.toy``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hamo_ray.config import BackboneConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-style ChatML, without the <think> handling of Qwen3's own template (our model never thinks).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast`` with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_qwen3(cfg: BackboneConfig, tokenizer, max_position_embeddings: int = 4096, seed: int = 0):
    """A randomly initialised Qwen3ForCausalLM sized by ``cfg`` for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return model


def save_backbone(model, tokenizer, path: str | Path) -> Path:
    """Save model + tokenizer in HF format (safetensors), loadable by transformers, peft and vLLM."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_random_backbone(
    path: str | Path, texts: Iterable[str] | None = None, cfg: BackboneConfig | None = None
) -> Path:
    """A small untrained backbone for tests of loading/serving code (weights random, tokenizer real)."""
    cfg = cfg or BackboneConfig(vocab_size=512)
    corpus = (
        list(texts)
        if texts is not None
        else [
            "Your task is to focus on the animal. This room is called the kitchen. You see a table.",
            "open door to hallway. go to hallway. look around. pick up thermometer. focus on orange.",
        ]
        * 50
    )
    tok = train_tokenizer(corpus, cfg.vocab_size)
    model = init_qwen3(cfg, tok)
    return save_backbone(model, tok, path)
