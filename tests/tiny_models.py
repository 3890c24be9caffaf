"""Tiny seeded random checkpoints of each supported architecture, saved as HF folders."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import torch
import transformers

from tests.tiny_families import FAMILY_CONFIGS

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "llama3": lambda: transformers.LlamaConfig(
        **{**TINY, "num_key_value_heads": 1},
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "smollm2": lambda: transformers.LlamaConfig(
        **{**TINY, "num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 96},
        tie_word_embeddings=True,
    ),
    "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=24, head_dim=16),
    # three KV heads (SmolLM2's count): two ranks hold two and one, with their query heads
    "llama-3kv": lambda: transformers.LlamaConfig(
        **{**TINY, "num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}
    ),
    # a vocabulary that no tensor-parallel split pads away: padding rows on the last rank
    "llama-odd-vocab": lambda: transformers.LlamaConfig(**{**TINY, "vocab_size": 300}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "llama-deep": lambda: transformers.LlamaConfig(
        **{**TINY, "num_hidden_layers": 8}
    ),  # progress inside a step
}


def make_tiny_model(kind: str, root: pathlib.Path | None = None, seed: int = 0) -> pathlib.Path:
    """Save a seeded random model of ``kind`` (cached by its config) and return its folder."""
    config = {**CONFIGS, **FAMILY_CONFIGS}[kind]()
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[
        :12
    ]
    root = root or pathlib.Path(tempfile.gettempdir()) / f"pdserve-tiny-models-{os.getuid()}"
    path = root / f"{kind}-{seed}-{digest}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init give peaked, tie-free logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    if path.exists():  # another process won the race
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return path
