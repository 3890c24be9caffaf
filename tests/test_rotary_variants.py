"""Each rotary variant's frequencies and attention factor equal transformers' own, on configs
shaped like real checkpoints (the model-level HF matches are in test_model_families.py)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pdserve.engine.layers.rotary import rotary_frequencies

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
CASES = {
    "linear": (transformers.LlamaConfig, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, {}),
    "llama3": (transformers.LlamaConfig, LLAMA3, {"max_position_embeddings": 131072}),
    "dynamic": (transformers.LlamaConfig, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, {}),
    "yarn-qwen": (
        transformers.Qwen2Config,
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 32768},
        {"max_position_embeddings": 131072},
    ),
    "yarn-mscale-untruncated": (
        transformers.LlamaConfig,
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 4096,
            "truncate": False,
            "rope_theta": 10000.0,
        },
        {"max_position_embeddings": 163840},
    ),
}


def _hf_config(cls, rope: dict, extra: dict) -> transformers.PreTrainedConfig:
    return cls(hidden_size=256, num_attention_heads=4, rope_parameters=dict(rope), **extra)


@pytest.mark.parametrize("name", CASES)
def test_frequencies_and_attention_factor_equal_transformers(name):
    cls, rope, extra = CASES[name]
    config = _hf_config(cls, rope, extra)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    ours = rotary_frequencies(
        64, dict(config.rope_parameters), config.max_position_embeddings, config.max_position_embeddings
    )
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq, atol=0, rtol=1e-6)
    assert ours.attention_factor == pytest.approx(hf_factor, rel=1e-12)


def test_longrope_short_and_long_sets_with_partial_rotary_equal_transformers():
    # Phi-4-mini's shape: 3/4 of each 64-channel head rotated, 24 factors per set.
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4096,
        "short_factor": [1.0 + i / 24 for i in range(24)],
        "long_factor": [1.0 + i / 3 for i in range(24)],
    }
    config = transformers.Phi3Config(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=rope
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=100)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=5000)
    ours = rotary_frequencies(48, dict(config.rope_parameters), 8192, config.max_position_embeddings)
    torch.testing.assert_close(ours.inv_freq, short, atol=0, rtol=1e-6)
    torch.testing.assert_close(ours.long_inv_freq, long, atol=0, rtol=1e-6)
    assert (ours.switch_position, ours.attention_factor) == (4096, pytest.approx(factor, rel=1e-12))
