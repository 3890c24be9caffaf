"""Defaults that size themselves (engine/machine/sizing.py, engine/machine/resources.py, engine/machine/cpu_env.py), and
explicit settings that still win exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.machine import resources
from pdserve.engine.machine.sizing import size_engine
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.tiny_models import make_tiny_model

GIB = 1 << 30


@pytest.fixture(scope="module")
def model() -> ModelConfig:
    return ModelConfig.from_path(make_tiny_model("llama"))


def _block_bytes(model: ModelConfig, block_size: int = 16) -> int:
    spec = KVCacheSpec(model.num_layers, 1, block_size, model.num_kv_heads, model.head_dim, "float32")
    return spec.bytes_per_block


def test_num_kv_blocks_is_exact(model):
    sizing = size_engine(
        EngineConfig(model=model.path, dtype="float32", num_kv_blocks=7),
        model,
        4096,
        cpus=2,
        available_bytes=GIB,
    )
    assert sizing.num_kv_blocks == 7 and sizing.kv_source == "num_kv_blocks"


def test_kv_cache_memory_mb_is_exact(model):
    sizing = size_engine(
        EngineConfig(model=model.path, dtype="float32", kv_cache_memory_mb=3),
        model,
        4096,
        available_bytes=GIB,
    )
    assert sizing.num_kv_blocks == (3 << 20) // _block_bytes(model)


def test_default_pool_is_the_fraction_of_available_memory(model):
    config = EngineConfig(
        model=model.path, dtype="float32", kv_cache_memory_fraction=0.5, max_num_seqs=1 << 16
    )
    sizing = size_engine(config, model, 4096, available_bytes=GIB // 8)
    assert sizing.num_kv_blocks == (GIB // 16) // _block_bytes(model)
    assert sizing.kv_source == "50% of 0.1 GiB available"


def test_default_pool_never_exceeds_what_max_num_seqs_full_sequences_fill(model):
    config = EngineConfig(model=model.path, dtype="float32", max_num_seqs=4)
    sizing = size_engine(config, model, max_model_len=100, available_bytes=64 * GIB)
    assert sizing.num_kv_blocks == 4 * 7  # ceil(100 / 16) blocks each
    assert sizing.kv_source.startswith("max_num_seqs x max_model_len")


def test_threads_default_to_usable_cpus_and_explicit_wins(model):
    assert (
        size_engine(
            EngineConfig(model=model.path, dtype="float32"), model, 64, cpus=3, available_bytes=GIB
        ).num_threads
        == 3
    )
    explicit = size_engine(
        EngineConfig(model=model.path, dtype="float32", num_threads=1), model, 64, cpus=3, available_bytes=GIB
    )
    assert explicit.num_threads == 1 and explicit.threads_source == "num_threads"


def test_max_threads_caps_the_automatic_count_only(model):
    def sized(**kw):
        config = EngineConfig(model=model.path, dtype="float32", **kw)
        return size_engine(config, model, 64, cpus=4, available_bytes=GIB)

    capped = sized(max_threads=2)
    assert capped.num_threads == 2 and capped.threads_source == "max_threads, of 4 usable CPUs"
    assert sized(max_threads=8).num_threads == 4  # a ceiling, never more than the CPUs
    assert sized(max_threads=2, num_threads=3).num_threads == 3  # explicit wins


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.95])
def test_fraction_outside_range_is_refused(fraction):
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(model="m", kv_cache_memory_fraction=fraction)


@pytest.mark.parametrize("name", ["kv_cache_memory_mb", "num_threads", "max_threads", "num_kv_blocks"])
def test_non_positive_sizes_are_refused(name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(model="m", **{name: 0})


def test_machine_figures_are_sane():
    assert 1 <= resources.usable_cpus() <= (os.cpu_count() or 1)
    available = resources.available_memory_bytes()
    assert available is not None and 0 < available


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run(
        [sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=300, check=True
    )


SHOW = "import os, torch; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("entry", ["from pdserve.engine import LLM", "import pdserve.cli.main"])
def test_the_entry_points_set_a_short_spin_before_torch(entry):
    assert _child(f"{entry}\n{SHOW}").stdout.strip() == "10000 None"


@pytest.mark.usefixtures("processes")
def test_importing_engine_modules_sets_nothing():
    # the router's torch-free imports, and the package itself, leave OpenMP alone
    assert (
        _child(
            f"import pdserve.engine, pdserve.engine.config, pdserve.protocol.block_hash\n{SHOW}"
        ).stdout.strip()
        == "None None"
    )


@pytest.mark.usefixtures("processes")
def test_an_explicit_openmp_setting_is_left_alone():
    code = "from pdserve.engine import LLM; import os; print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert _child(code, GOMP_SPINCOUNT="1000").stdout.strip() == "None 1000"
    assert _child(code, OMP_WAIT_POLICY="PASSIVE").stdout.strip() == "PASSIVE None"


@pytest.mark.usefixtures("processes")
def test_after_torch_loaded_the_engine_sets_nothing():
    code = "import torch, os\nfrom pdserve.engine import LLM\nprint(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    assert _child(code).stdout.strip() == "None None"


@pytest.mark.usefixtures("processes")
def test_engine_start_prints_its_chosen_sizes_once():
    code = (
        "from pdserve.engine import LLM\n"
        f"LLM({str(make_tiny_model('llama'))!r}, max_num_seqs=2, max_model_len=64, kv_cache_memory_fraction=0.01)\n"
    )
    lines = [line for line in _child(code).stderr.splitlines() if line.startswith("engine: ")]
    assert len(lines) == 1
    assert "torch threads (usable CPUs)" in lines[0] and "blocks x 16 tokens" in lines[0]
    assert "GOMP_SPINCOUNT=10000 (engine default)" in lines[0]
    if resources.usable_cpus() > 1 and len(os.sched_getaffinity(0)) == resources.usable_cpus():
        assert "fewer torch threads while other processes load these CPUs" in lines[0]
