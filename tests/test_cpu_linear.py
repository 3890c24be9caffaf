"""Linear layers through oneDNN on packed weights (kernels/cpu_linear.py) against F.linear and HF."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor.model_runner import ModelRunner
from pdserve.kernels import cpu_linear
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.engine_helpers import hf_logits, paged_logits
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(
    not cpu_linear.enabled(torch.float32), reason="oneDNN's packed linear ops are not in this torch"
)


def _linear(n_in: int, n_out: int, bias: bool, dtype: torch.dtype, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=gen))
    return layer.to(dtype)


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear_in_fp32(rows, bias):
    layer = _linear(576, 960, bias, torch.float32, seed=rows)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = cpu_linear.PackedLinear(layer)(x)
        want = torch.nn.functional.linear(
            x.double(), layer.weight.double(), None if layer.bias is None else layer.bias.double()
        )
    assert got.shape == (rows, 960) and got.dtype == torch.float32
    # fp32 sums of 576 products of N(0, 1) values: rounding is ~1e-5 of their size (~24)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-4)


def test_packed_linear_takes_leading_dims_strided_rows_and_bf16():
    layer = _linear(64, 48, True, torch.float32, seed=3)
    packed = cpu_linear.PackedLinear(layer)
    x = torch.randn(2, 5, 128)[..., ::2]  # [2, 5, 64], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), layer(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(packed.weight, layer.weight.detach())  # the packed layout unpacks exactly
    if cpu_linear.enabled(torch.bfloat16):
        layer16 = layer.to(torch.bfloat16)
        x16 = torch.randn(9, 64).bfloat16()
        with torch.inference_mode():
            got = cpu_linear.PackedLinear(layer16)(x16).float()
        torch.testing.assert_close(got, layer16(x16).float(), rtol=2e-2, atol=5e-2)


def test_unsupported_dtypes_keep_the_plain_layers():
    assert not cpu_linear.enabled(torch.float64)  # only fp32 and bf16 are ever packed


def _runner(path: str) -> ModelRunner:
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    return ModelRunner(cfg, EngineConfig(model=path, dtype="float32"), spec)


def test_the_runner_packs_every_linear_and_a_tied_head_from_the_embedding():
    path = str(make_tiny_model("gemma"))  # tied embeddings
    runner = _runner(path)
    assert runner.packed_linear
    layers = _linear_layers(runner)
    assert len(layers) == 4 * runner.model_config.num_layers + 1  # qkv, o, gate_up, down; the head
    assert all(m.packed_weight is not None and m.weight is None for m in layers)  # no plain copy kept
    embedding = runner.model.model.embed_tokens.weight  # the tied head's, kept by the embedding
    assert torch.equal(runner.model.lm_head.packed_weight.to_dense(), embedding)


def _linear_layers(runner: ModelRunner) -> list[nn.Module]:
    """The model's linear layers (engine/layers/linear.py's): none is a plain nn.Linear."""
    assert not any(type(m) is nn.Linear for m in runner.model.modules())
    return [m for m in runner.model.modules() if getattr(m, "packable", False)]


def test_packing_off_keeps_nn_linear_and_both_match_hf(monkeypatch):
    path = str(make_tiny_model("llama"))
    tokens = list(range(5, 45))
    assert _runner(path).packed_linear
    packed = paged_logits(path, tokens, chunks=[17, 23])
    monkeypatch.setenv("PDSERVE_PACKED_LINEAR", "0")
    runner = _runner(path)
    assert not runner.packed_linear
    assert all(m.packed_weight is None and m.weight is not None for m in _linear_layers(runner))
    plain = paged_logits(path, tokens, chunks=[17, 23])
    ref = hf_logits(path, tokens)
    assert (packed - ref).abs().max().item() < 1e-4
    assert (plain - ref).abs().max().item() < 1e-4
