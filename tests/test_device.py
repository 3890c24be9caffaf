"""Device selection: on a CPU-only machine cpu and auto run, cuda is a clear error, bad names are
refused; the flag reaches nodes from PDSERVE_DEVICE and their status says which device they use."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.launcher.env_flags import flags_from_env
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

# Only what a GPU would change is CPU-only: names, flags and dtype rules run on every machine.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@cpu_only
@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_and_auto_serve_on_the_cpu_equal_to_hf(device):
    path = str(make_tiny_model("llama"))
    llm = LLM(model=path, num_kv_blocks=32, device=device)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert llm.engine.device == torch.device("cpu")
    assert out[0].outputs[0].token_ids == hf_greedy(path, [5, 6, 7, 8], 5)


@cpu_only
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_a_gpu_is_a_clear_error(device):
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        LLM(model=str(make_tiny_model("llama")), num_kv_blocks=32, device=device)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU", ""])
def test_an_unknown_device_name_is_refused_by_the_config(device):
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        EngineConfig(model="m", device=device)


def test_pdserve_device_becomes_the_node_flag():
    assert flags_from_env("decode", {"PDSERVE_DEVICE": "cpu"}) == ["--device", "cpu"]


@pytest.mark.usefixtures("processes")
@cpu_only
def test_node_status_names_its_device(tmp_path, default_model_dir):
    from tests.cluster import Client, NodeProcess

    node = NodeProcess(
        "decode", str(make_tiny_model("llama")), tmp_path, None, ["--num-kv-blocks", "16", "--device", "auto"]
    )
    client = Client()
    try:
        assert client.status(node.wait_ready())["device"] == "cpu"
    finally:
        client.close()
        node.close()


def test_the_default_dtype_follows_the_device_and_the_checkpoint(monkeypatch):
    from pdserve.engine.machine import device
    from pdserve.engine.machine.device import explain_dtype, resolve_dtype

    assert EngineConfig(model="m").dtype == "auto"
    assert resolve_dtype("auto", "cpu", "float32") == "float32"
    assert resolve_dtype("auto", "cuda", "float32") == "bfloat16"
    assert resolve_dtype("float16", "cpu", "bfloat16") == "float16"  # --dtype overrides
    native = device.cpu_computes_bf16()
    for checkpoint in ("bfloat16", "float16", "GGUF Q4_1"):
        dtype, why = explain_dtype("auto", "cpu", checkpoint)
        assert dtype == ("bfloat16" if native else "float32") and checkpoint in why
    # a CPU without bf16 arithmetic (faked: the feature test is the only way to have one here)
    monkeypatch.setattr(device, "cpu_computes_bf16", lambda: False)
    assert explain_dtype("auto", "cpu", "bfloat16") == (
        "float32",
        "auto: the checkpoint is bfloat16, but this CPU has no AVX512-BF16 or AMX",
    )
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(model="m", dtype="float64")


def test_an_engine_runs_a_float32_checkpoint_in_float32_and_a_bf16_one_as_the_cpu_allows(tmp_path):
    import transformers

    from pdserve.engine.machine.device import cpu_computes_bf16

    fp32 = LLM(model=str(make_tiny_model("llama")), num_kv_blocks=16, device="cpu")
    assert fp32.engine.config.dtype == "float32" and fp32.engine.kv_spec.dtype == "float32"
    assert fp32.engine.model_config.checkpoint_dtype == "float32"
    folder = tmp_path / "bf16"
    model = transformers.AutoModelForCausalLM.from_pretrained(make_tiny_model("llama"), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    bf16 = LLM(model=str(folder), num_kv_blocks=16, device="cpu")
    assert bf16.engine.model_config.checkpoint_dtype == "bfloat16"
    expected = "bfloat16" if cpu_computes_bf16() else "float32"
    assert bf16.engine.config.dtype == expected and bf16.engine.kv_spec.dtype == expected
    pinned = LLM(model=str(folder), num_kv_blocks=16, device="cpu", dtype="float32")
    assert pinned.engine.kv_spec.dtype == "float32"


def test_the_start_up_line_names_the_dtype_why_and_offers_bf16_where_the_cpu_has_it():
    from pdserve.engine.machine.device import cpu_computes_bf16, describe_dtype

    cpu = torch.device("cpu")
    fp32 = describe_dtype(torch.float32, cpu, "auto: the checkpoint is float32")
    assert fp32.startswith("dtype float32 (auto: the checkpoint is float32")
    assert ("--dtype bfloat16" in fp32) == cpu_computes_bf16()
    assert describe_dtype(torch.bfloat16, cpu) == "dtype bfloat16 (--dtype)"


def test_the_default_model_as_shipped_runs_in_bf16_where_the_cpu_computes_it(
    shipped_default_model, default_model_dir
):
    """Dequantized from GGUF Q4_1, it carries less than bf16's precision: auto picks bf16 where the
    CPU has bf16 arithmetic; the tests' fp32 view of the same weights (conftest.py) stays fp32."""
    from pdserve.engine.machine.device import cpu_computes_bf16

    shipped = LLM(model=str(shipped_default_model), num_kv_blocks=16, device="cpu").engine
    assert shipped.model_config.checkpoint_dtype == "GGUF Q4_1"
    assert shipped.config.dtype == ("bfloat16" if cpu_computes_bf16() else "float32")
    assert "GGUF Q4_1" in shipped.dtype_why
    assert LLM(model=str(default_model_dir), num_kv_blocks=16, device="cpu").engine.config.dtype == "float32"
