"""W8A8 int8 linear layers (``quantization="int8"``, kernels/cpu_int8.py) against an oracle built
here from Hugging Face's model: every nn.Linear but the LM head with its weight quantized and
dequantized per output channel, and its input per token (fake quantization, float32 F.linear).
The engine's oneDNN int8 path must give that model's greedy tokens and its logprobs within 1e-4:
alone, in a concurrent batch with chunked prompts, at tensor_parallel_size=2 (each rank quantizes
its own share of a row-parallel layer's inputs) and with LoRA adapters on the quantized base.
Quantization's distance from float32 is measured in bench/accuracy.py, not here."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import pathlib
import re
import shutil

import pytest
import safetensors.torch
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.executor.model_runner import check_quantization
from pdserve.engine.executor.platform import SplitPlatform
from pdserve.engine.layers.linear import Packable
from pdserve.kernels import cpu_ext, cpu_int8
from tests.engine_helpers import greedy_with_logprobs, hf_model
from tests.test_lora_model import _adapters, _peft_model, _prompt
from tests.test_protocol_types import FP
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_int8.available() is not None, reason=str(cpu_int8.available()))
# Logprobs against the simulated model. Both compute the same int8 products, but an activation
# that sits within float32 rounding of a quantization step's midpoint may round the other way
# on one side (the two compute the layers' inputs in other orders): one such element moves a
# logprob by about 1e-3 on these models. A wrong scale or layout moves it by far more than this.
ATOL = 5e-3
ROW_PARALLEL = ("o_proj", "down_proj")  # their input columns split over the ranks


def _fake(t: torch.Tensor) -> torch.Tensor:
    """Each row (last dim) as symmetric int8 with scale max|row| / 127, dequantized, in float32."""
    t = t.float()
    amax = t.abs().amax(-1, keepdim=True)
    scale = amax / 127
    q = torch.round(t / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-127, 127)
    return torch.where(amax > 0, q * scale, torch.zeros_like(t))


def _fake_split(t: torch.Tensor, parts: int) -> torch.Tensor:
    return torch.cat([_fake(c) for c in t.chunk(parts, dim=-1)], dim=-1)


def fake_quantized(model: nn.Module, tp: int = 1) -> nn.Module:
    """``model`` with its linear layers' int8 arithmetic simulated in float32: at ``tp`` ranks a
    row-parallel layer's weight columns and input channels are quantized in ``tp`` shares. GPT-2's
    Conv1D layers hold their weight [in, out]; a MoE router (``gate``) stays unquantized, as the
    engine's does."""
    for name, module in model.named_modules():
        conv1d = type(module) is Conv1D
        if type(module) is not nn.Linear and not conv1d:
            continue
        if "lm_head" in name or "lora_" in name or name.endswith(".gate"):
            continue
        parts = tp if any(p in name for p in ROW_PARALLEL) else 1
        with torch.no_grad():
            if conv1d:
                module.weight.copy_(_fake_split(module.weight.t(), parts).t())
            else:
                module.weight.copy_(_fake_split(module.weight, parts))
        module.register_forward_pre_hook(lambda _m, args, parts=parts: (_fake_split(args[0], parts),))
    return model


@functools.cache
def _model(path: str, tp: int, adapter: str | None) -> nn.Module:
    # a copy: hf_model's and _peft_model's are cached and shared with other tests
    base = hf_model(path) if adapter is None else _peft_model(path, adapter)
    return fake_quantized(copy.deepcopy(base), tp)


@functools.cache
def _oracle(path: str, prompt: tuple[int, ...], max_tokens: int, tp: int = 1, adapter: str | None = None):
    """The fake-quantized model's greedy tokens and their logprobs, one full forward a token."""
    return greedy_with_logprobs(_model(path, tp, adapter), prompt, max_tokens)


def _greedy(max_tokens: int, adapter: str | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, adapter=adapter
    )


def _assert_oracle(path: str, prompts, outputs, max_tokens, tp: int = 1, adapters=None) -> None:
    adapters = adapters or [None] * len(prompts)
    for prompt, out, adapter in zip(prompts, outputs, adapters, strict=True):
        want, want_lp = _oracle(path, tuple(prompt), max_tokens, tp, adapter)
        got = out.outputs[0]
        assert got.token_ids == want, (len(prompt), adapter)
        assert [e.logprob for e in got.logprobs] == pytest.approx(want_lp, abs=ATOL), (len(prompt), adapter)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_int8_matmul_is_the_fake_quantized_product(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 160, generator=gen)
    weight[7] = 0  # an all-zero output channel
    x = (torch.randn(rows, 160, generator=gen) * 3).to(dtype)
    x[0] = 0  # an all-zero token
    bias = torch.randn(96, generator=gen).to(dtype)
    with torch.inference_mode():
        got = cpu_int8.int8_matmul(x, cpu_int8.pack_weight(weight.to(dtype)), bias)
    want = nn.functional.linear(_fake(x), _fake(weight.to(dtype)), bias.float())
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert torch.equal(got[0].float(), bias.float().to(dtype).float())  # a zero token: the bias alone


@pytest.mark.skipif(not cpu_ext.enabled(), reason="the CPU extension is not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_activation_quantization_gives_the_torch_path_s_bytes(dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 300, generator=gen) * torch.logspace(-3, 3, 37)[:, None]).to(dtype)
    x[5] = 0
    q, scale = cpu_int8.quantize_rows(x, native=True)
    q_ref, scale_ref = cpu_int8.quantize_rows(x, native=False)
    assert q.dtype == torch.uint8 and torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert int(q[5].min()) == int(q[5].max()) == cpu_int8.ZERO_POINT
    acc = torch.randn(37, 50, generator=gen)
    bias = torch.randn(50, generator=gen).to(dtype)
    got = cpu_int8.dequantize_rows(acc, scale, bias, dtype, native=True)
    want = cpu_int8.dequantize_rows(acc, scale, bias, dtype, native=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # within an FMA's rounding


def test_a_concurrent_chunked_batch_gives_the_fake_quantized_model_s_tokens():
    path = str(make_tiny_model("llama"))
    llm = LLM(path, quantization="int8", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    runner = llm.engine.executor.runner
    layers = [m for m in runner.model.modules() if isinstance(m, Packable)]
    quantized = [m for m in layers if m.int8_weight is not None]
    assert len(quantized) == 4 * 2 and all(m.weight is None for m in quantized)  # qkv, o, gate_up, down
    assert [m.quantizable for m in layers if m.int8_weight is None] == [False]  # the LM head only
    prompts = [_prompt(i, n) for i, n in enumerate([7, 30, 5, 19, 12])]  # 30 and 19: in chunks
    with llm:
        outputs = llm.generate(prompts, _greedy(8))
    _assert_oracle(path, prompts, outputs, 8)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "phi3", "gpt2", "olmo2", "mixtral"])
def test_each_family_gives_its_fake_quantized_model_s_tokens(kind):
    """Fused checkpoint tensors (Phi-3's qkv, GPT-2's Conv1D c_attn), soft-capping, post-norms,
    and a MoE model whose experts stay in the dtype (only its attention is quantized)."""
    path = str(make_tiny_model(kind))
    prompts = [_prompt(30 + i, n) for i, n in enumerate([7, 19])]
    with LLM(path, quantization="int8", num_kv_blocks=64) as llm:
        outputs = llm.generate(prompts, _greedy(6))
    _assert_oracle(path, prompts, outputs, 6)


@pytest.mark.usefixtures("processes")
def test_two_ranks_quantize_their_own_shares_and_give_that_model_s_tokens():
    path = str(make_tiny_model("llama"))
    prompts = [_prompt(10 + i, n) for i, n in enumerate([9, 21, 4])]
    with LLM(path, quantization="int8", tensor_parallel_size=2, num_kv_blocks=64) as llm:
        outputs = llm.generate(prompts, _greedy(6))
    _assert_oracle(path, prompts, outputs, 6, tp=2)


def test_lora_adapters_on_a_quantized_base_add_their_product_in_the_compute_dtype():
    path = str(make_tiny_model("llama"))
    folders = _adapters("llama")
    rows = [(None, 7), ("attn", 12), ("all", 5)]
    prompts = [_prompt(20 + i, n) for i, (_, n) in enumerate(rows)]
    options = dict(
        enable_lora=True, max_loras=2, lora_modules=(("attn", folders["attn"]), ("all", folders["all"]))
    )
    with LLM(path, quantization="int8", num_kv_blocks=64, **options) as llm:
        outputs = llm.generate(prompts, [_greedy(6, a) for a, _ in rows])
    _assert_oracle(path, prompts, outputs, 6, adapters=[None if a is None else folders[a] for a, _ in rows])


def test_int8_is_refused_where_it_cannot_run_naming_why():
    with pytest.raises(ValueError, match="quantization int8 runs on the CPU only"):
        check_quantization("int8", SplitPlatform())
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(make_tiny_model("llama")), quantization="int4")


def test_nodes_of_different_quantization_never_share_kv():
    int8 = dataclasses.replace(FP, quantization="int8")
    assert int8.first_difference(FP) == "quantization" and FP.quantization == ""


# --------------------------------------------------------------------------- W8A8 checkpoints

W8A8_CONFIG = {  # llm-compressor's W8A8 preset as it writes config.json (what vLLM loads)
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def w8a8_checkpoint(source: pathlib.Path, folder: pathlib.Path, scale_dtype=torch.float32) -> pathlib.Path:
    """``source``'s checkpoint written as compressed-tensors W8A8: every decoder linear weight as
    int8 with a [out, 1] scale (min-max, round to nearest), the rest as it was."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, folder / item.name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": W8A8_CONFIG}))
    tensors = {}
    for name, tensor in safetensors.torch.load_file(source / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            scale = (tensor.abs().amax(dim=1, keepdim=True) / 127).to(scale_dtype)
            tensors[name] = torch.round(tensor / scale.float()).clamp(-127, 127).to(torch.int8)
            tensors[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            tensors[name] = tensor
    safetensors.torch.save_file(tensors, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_a_w8a8_checkpoint_runs_as_int8_and_equals_quantizing_at_load(tmp_path, scale_dtype):
    """The int8 values and scales a W8A8 checkpoint stores are the ones --quantization int8 makes
    from its floats (min-max per channel): the same engine, the same tokens and logprobs."""
    source = make_tiny_model("llama")
    stored = w8a8_checkpoint(source, tmp_path / "w8a8", scale_dtype)
    prompts = [_prompt(40 + i, n) for i, n in enumerate([9, 23])]
    with LLM(str(stored), num_kv_blocks=64) as llm:  # no flag: the checkpoint says int8
        assert llm.engine.config.quantization == "int8"
        got = llm.generate(prompts, _greedy(6))
    with LLM(str(source), num_kv_blocks=64, quantization="int8") as llm:
        want = llm.generate(prompts, _greedy(6))
    if scale_dtype == torch.float32:  # the same int8 weights and fp32 scales
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert [e.logprob for e in g.outputs[0].logprobs] == pytest.approx(
                [e.logprob for e in w.outputs[0].logprobs], abs=1e-5
            )
    else:  # bf16 scales round: its int8 values differ from those of the floats; simulate them
        _assert_oracle(str(_dequantized(stored, source, tmp_path / "dequantized")), prompts, got, 6)


def _dequantized(stored: pathlib.Path, source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """A float checkpoint of ``stored``'s W8A8 weights (q * scale), with ``source``'s config."""
    shutil.copytree(source, folder)
    tensors = safetensors.torch.load_file(stored / "model.safetensors")
    floats = {
        name: t.float() * tensors[name.removesuffix("weight") + "weight_scale"].float()
        if t.dtype == torch.int8
        else t
        for name, t in tensors.items()
        if not name.endswith("weight_scale")
    }
    safetensors.torch.save_file(floats, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"quant_method": "gptq"}, "quantized with 'gptq'"),
        ({"format": "pack-quantized"}, "format is 'pack-quantized'"),
        (
            {
                "config_groups": {
                    "g": {"weights": {**W8A8_CONFIG["config_groups"]["group_0"]["weights"], "num_bits": 4}}
                }
            },
            "num_bits",
        ),
    ],
)
def test_other_quantized_checkpoints_are_refused_naming_what_they_hold(tmp_path, change, named):
    source = make_tiny_model("llama")
    folder = tmp_path / "q"
    folder.mkdir()
    for item in source.iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "quantization_config": {**W8A8_CONFIG, **change}})
    )
    with pytest.raises(ValueError, match=re.escape(named)):
        LLM(str(folder), num_kv_blocks=16)
