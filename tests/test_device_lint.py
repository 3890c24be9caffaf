"""No tensor factory without ``device=`` in the kernels and the model code: a CPU-built index or
mask beside CUDA tensors fails only on a GPU, which this project rarely has (GPU_PLAN.md, Phase 0).
Each deliberate host tensor is listed with its reason; a new one must be added here or given a
device. tests/test_meta_forward.py checks the model forward itself, on ``meta``."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FACTORIES = frozenset(
    {"arange", "zeros", "ones", "empty", "full", "tensor", "rand", "randn", "randint", "linspace"}
)
# Parameters and rotary tables: built once by the module's constructor on the default device
# (the caller's ``with torch.device(...)``, as for nn.Linear's own weights), moved with the module.
_CONSTRUCTION = "construction-time, on the default device, like nn.Linear's weights"
ALLOWED = {
    (
        "kernels/ops.py",
        "paged_decode_attention",
        "arange",
    ): "the C++ CPU kernel's row starts (CPU path only)",
    ("kernels/cpu_linear.py", "_self_check", "randn"): "oneDNN's start-up self-check, CPU by definition",
    (
        "kernels/kv_quant.py",
        "quantize_kv_int8_ref",
        "empty",
    ): "the reference computes on the host, then moves",
    ("kernels/kv_quant.py", "quantize_kv_int8_ref", "tensor"): "a host scalar of the host reference",
    ("kernels/testing.py", "*", "*"): "test inputs, moved by the tests",
    ("engine/layers/moe.py", "__init__", "zeros"): _CONSTRUCTION,
    ("engine/layers/moe.py", "__init__", "empty"): _CONSTRUCTION,
    ("engine/layers/norms.py", "__init__", "zeros"): _CONSTRUCTION,
    ("engine/layers/norms.py", "__init__", "ones"): _CONSTRUCTION,
    ("engine/models/gpt2.py", "__init__", "empty"): _CONSTRUCTION,
    ("engine/models/gpt2.py", "__init__", "zeros"): _CONSTRUCTION,
    ("engine/layers/linear.py", "_parameter", "empty"): _CONSTRUCTION,
    ("engine/layers/rotary.py", "__init__", "arange"): _CONSTRUCTION,
    ("engine/layers/rotary.py", "_base_inv_freq", "arange"): _CONSTRUCTION,
    ("engine/layers/rotary.py", "_yarn", "arange"): _CONSTRUCTION,
    ("engine/layers/rotary.py", "_longrope", "arange"): _CONSTRUCTION,
    ("engine/layers/rotary.py", "_longrope", "tensor"): _CONSTRUCTION,
    (
        "engine/models/decoder.py",
        "embed",
        "tensor",
    ): "a 0-dim host scalar (HF rounds the embedding scale to the weights' dtype): it mixes with "
    "tensors on any device, read on the host as a kernel argument, with no copy and no sync",
}
# The step path: what runs, or builds tensors, while the engine serves (engine/executor/platform.py's
# start-up code and the CPU-only helpers, such as kv_prefault, are not in it).
LINTED = (
    "kernels",
    "engine/layers",
    "engine/models",
    "engine/executor/model_runner.py",
    "engine/executor/cuda_graphs.py",
    "engine/executor/attention.py",
    "engine/sampling/sampler.py",
    "engine/sampling/logits_rules.py",
    "engine/llm_engine.py",
    "engine/sampling/stop_rules.py",
)


def _unplaced(path: pathlib.Path) -> list[tuple[str, str, int]]:
    """(function, factory, line) of each torch.<factory>(...) call without device=."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            call = child
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "torch"
                and call.func.attr in FACTORIES
                and not any(k.arg == "device" for k in call.keywords)
            ):
                found.append((function, call.func.attr, call.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


@pytest.mark.parametrize("folder", LINTED)
def test_tensor_factories_name_their_device(folder):
    offenders = []
    target = ROOT / folder
    for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
        rel = path.relative_to(ROOT).as_posix()
        for function, factory, line in _unplaced(path):
            if (rel, "*", "*") in ALLOWED or (rel, function, factory) in ALLOWED:
                continue
            offenders.append(f"{rel}:{line} torch.{factory} in {function}")
    assert not offenders, "give these a device= (or list them in ALLOWED with a reason):\n" + "\n".join(
        offenders
    )


def test_the_lint_sees_a_factory_without_a_device(tmp_path):
    sample = tmp_path / "k.py"
    sample.write_text(
        "import torch\ndef f(x):\n    return torch.arange(4), torch.zeros(2, device=x.device)\n"
    )
    assert _unplaced(sample) == [("f", "arange", 3)]


def test_an_index_tensor_on_another_device_is_a_clear_assertion():
    import torch

    from pdserve.kernels.kv_write import write_kv_cache_triton

    key = torch.zeros(2, 2, 16)
    caches = [torch.zeros(4, 8, 2, 16) for _ in range(2)]
    with pytest.raises(AssertionError, match="slot_mapping is on meta"):
        write_kv_cache_triton(key, key, *caches, torch.zeros(2, dtype=torch.int64, device="meta"))
