"""The platform layer (engine/executor/platform.py) verified on the CPU: the split-and-poison platform runs
the HF-exact suites (so nothing reads a host buffer where a GPU would hold the data on the
device), its fake streams defer copies to their events, the GPU's pool sizing works from
injected memory figures, and the profile run executes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.executor import platform as platform_module
from pdserve.engine.executor.model_runner import ModelRunner, StepInputs, largest_prefill
from pdserve.engine.executor.platform import (
    TEST_PLATFORM_ENV,
    CUDAPlatform,
    Platform,
    SplitPlatform,
    resolve_platform,
)
from pdserve.engine.machine.sizing import DeviceMemory, DraftNeeds, size_device_pool, size_engine
from pdserve.engine.sampling.draft_model import draft_engine_config, draft_needs
from pdserve.protocol.kv_layout import KVCacheSpec
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv(TEST_PLATFORM_ENV, "split")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]


def test_the_split_platform_serves_a_mixed_batch_equal_to_hf(split):
    path = str(make_tiny_model("llama"))
    llm = LLM(model=path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=24)  # chunked prefill
    assert isinstance(llm.engine.platform, SplitPlatform) and not llm.engine.runner.packed_linear
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]


def test_reading_the_host_copy_fails_on_the_split_platform(split, monkeypatch):
    """The negative control: inputs read from the (poisoned) host buffer, as a bug on a GPU
    would read stale host memory, do not give HF's tokens."""
    real = StepInputs.upload

    def host_views(self, **arrays):
        out = real(self, **arrays)
        host = self._host.numpy()
        offset, views = 0, {}
        for name, a in arrays.items():
            views[name] = torch.from_numpy(host[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape))
            offset = -(-(offset + a.nbytes) // self.ALIGN) * self.ALIGN
        assert views.keys() == out.keys()
        return views

    monkeypatch.setattr(StepInputs, "upload", host_views)
    path = str(make_tiny_model("llama"))
    llm = LLM(model=path, num_kv_blocks=64, block_size=4)
    prompt = _prompts()[1]
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    except (IndexError, RuntimeError, AssertionError):
        return  # poisoned indices are out of range: the read is caught
    assert out[0].outputs[0].token_ids != hf_greedy(path, prompt, 4)


@pytest.mark.usefixtures("processes")
def test_the_hf_exact_suites_pass_on_the_split_platform():
    env = dict(os.environ, **{TEST_PLATFORM_ENV: "split"})
    files = ["tests/test_engine_hf_exact.py", "tests/test_engine_paths.py", "tests/test_sampling.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_a_copy_on_a_fake_stream_lands_only_at_its_event():
    platform = SplitPlatform()
    src, dst = torch.arange(8, device="cpu"), torch.zeros(8, dtype=torch.int64, device="cpu")
    stream, event = platform.stream(), platform.event()
    platform.copy(dst, src, stream)
    src.fill_(-1)  # the copy takes the bytes as they were when it was issued
    event.record(stream)
    assert dst.tolist() == [0] * 8  # read before the event: stale, as a GPU's would be
    event.synchronize()
    assert dst.tolist() == list(range(8))


def test_the_cpu_platform_aliases_and_the_split_one_separates_and_poisons():
    a = torch.arange(5, device="cpu").numpy()
    on_cpu = StepInputs(Platform()).upload(a=a)["a"]
    assert on_cpu.data_ptr() == a.ctypes.data  # zero copies on the CPU
    inputs = StepInputs(SplitPlatform())
    on_split = inputs.upload(a=a, b=a.astype("int32"))
    assert on_split["a"].tolist() == list(range(5)) and on_split["b"].dtype == torch.int32
    assert on_split["a"].data_ptr() != a.ctypes.data
    assert set(inputs._host[:8].tolist()) == {0x7F}  # the host copy is unusable after the upload


def test_resolve_platform_on_this_machine(monkeypatch):
    monkeypatch.delenv(TEST_PLATFORM_ENV, raising=False)
    assert type(resolve_platform("cpu")) is Platform
    if not torch.cuda.is_available():
        assert type(resolve_platform("auto")) is Platform
    monkeypatch.setenv(TEST_PLATFORM_ENV, "split")
    assert type(resolve_platform("cpu")) is SplitPlatform


def test_cuda_starts_with_a_warning_that_it_has_not_run_on_a_gpu(monkeypatch, caplog):
    # No GPU here: torch's answers are faked to reach the CUDA branch (activate is a set_device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(CUDAPlatform, "activate", lambda self: None)
    with caplog.at_level("WARNING", logger="pdserve.engine.executor.platform"):
        platform = resolve_platform("cuda:1")
        assert isinstance(platform, CUDAPlatform) and platform.device == torch.device("cuda", 1)
        assert "has not yet run on a GPU" in caplog.text
        assert type(resolve_platform("auto")) is Platform  # auto waits for the one-shot's table
    with pytest.raises(ValueError, match="sees 2 CUDA device"):
        resolve_platform("cuda:2")


def _tiny_sizing(model: ModelConfig, **options):
    config = EngineConfig(model=model.path, dtype="float32", **options)
    return config, size_engine(config, model, 4096, cpus=2, available_bytes=GIB)


def test_the_gpu_pool_gets_what_weights_and_the_profiled_peak_leave():
    model = ModelConfig.from_path(make_tiny_model("llama"))
    config, sizing = _tiny_sizing(model, gpu_memory_utilization=0.5, max_num_seqs=1 << 20)
    block = KVCacheSpec(
        model.num_layers, 1, 16, model.num_kv_heads, model.head_dim, "float32"
    ).bytes_per_block
    # 80 GiB device, 70 free at start; the engine's context holds 1, its allocator reached 12 at
    # the step's peak (9 of weights, 3 of activations): 40 - 1 - 12 = 27 GiB for the pool
    memory = DeviceMemory(80 * GIB, 70 * GIB, GIB, 12 * GIB, peak=12 * GIB, allocated=9 * GIB)
    out = size_device_pool(sizing, config, 4096, block, memory, "cuda:0")
    assert out.num_kv_blocks == 27 * GIB // block and out.kv_pool_bytes == out.num_kv_blocks * block
    assert "50% of 80.0 GiB on cuda:0" in out.kv_source
    # the cap by max_num_seqs x max_model_len holds as on the CPU
    config, sizing = _tiny_sizing(model, gpu_memory_utilization=0.5, max_num_seqs=2)
    assert size_device_pool(sizing, config, 4096, block, memory, "cuda:0").num_kv_blocks == 2 * 4096 // 16


def test_gpu_sizing_refuses_a_share_that_is_not_free_or_leaves_no_pool():
    model = ModelConfig.from_path(make_tiny_model("llama"))
    config, sizing = _tiny_sizing(model, gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="only 40.0 GiB is free"):
        size_device_pool(
            sizing, config, 4096, 1 << 20, DeviceMemory(80 * GIB, 40 * GIB, GIB, 9 * GIB, 0, 0), "cuda:0"
        )
    with pytest.raises(ValueError, match="leaving no room for a KV pool"):
        size_device_pool(
            sizing, config, 4096, 1 << 20, DeviceMemory(80 * GIB, 80 * GIB, GIB, 71 * GIB, 0, 0), "cuda:0"
        )
    config, sizing = _tiny_sizing(model, num_kv_blocks=5)  # an explicit pool still wins
    assert (
        size_device_pool(sizing, config, 4096, 1, DeviceMemory(1, 1, 0, 0, 0, 0), "cuda:0").num_kv_blocks == 5
    )


def test_with_a_draft_model_one_budget_holds_both_pools_and_the_drafts_weights():
    model = ModelConfig.from_path(make_tiny_model("llama"))
    config, sizing = _tiny_sizing(model, gpu_memory_utilization=0.5, max_num_seqs=1 << 20)
    block = KVCacheSpec(
        model.num_layers, 1, 16, model.num_kv_heads, model.head_dim, "float32"
    ).bytes_per_block
    draft = DraftNeeds(weight_bytes=2 * GIB, block_bytes=block // 2, extra_blocks=1000)
    memory = DeviceMemory(80 * GIB, 70 * GIB, GIB, 12 * GIB, peak=12 * GIB, allocated=9 * GIB)  # held 13 GiB
    out = size_device_pool(sizing, config, 4096, block, memory, "cuda:0", draft)
    # 40 GiB share - 13 held - 2 of draft weights - its 1000 extra blocks, then a target block and
    # its draft block each
    room = 27 * GIB - 2 * GIB - 1000 * draft.block_bytes
    assert out.num_kv_blocks == room // (block + draft.block_bytes)
    used = memory.held + draft.fixed_bytes + out.num_kv_blocks * (block + draft.block_bytes)
    assert used <= 40 * GIB < used + block + draft.block_bytes  # all of the share, and no more
    assert "the draft model's weights and pool" in out.kv_source
    alone = size_device_pool(sizing, config, 4096, block, memory, "cuda:0")
    assert alone.num_kv_blocks == 27 * GIB // block > out.num_kv_blocks
    with pytest.raises(ValueError, match="weights, the draft model and the profile run hold"):
        size_device_pool(sizing, config, 4096, block, memory, "cuda:0", DraftNeeds(28 * GIB, block, 0))


def test_the_drafts_needs_are_its_real_weights_and_the_pool_its_engine_gets():
    target, draft = make_tiny_model("llama"), make_tiny_model("qwen2", seed=3)
    config = EngineConfig(
        model=str(target),
        dtype="bfloat16",
        speculative_model=str(draft),
        num_speculative_tokens=4,
        block_size=4,
    )
    needs = draft_needs(config, torch.bfloat16)
    draft_cfg = ModelConfig.from_path(draft)
    runner = ModelRunner(draft_cfg, EngineConfig(model=str(draft), dtype="bfloat16", block_size=4))
    assert needs.weight_bytes == runner.weight_bytes  # counted on the meta device, exactly
    spec = KVCacheSpec(draft_cfg.num_layers, 1, 4, draft_cfg.num_kv_heads, draft_cfg.head_dim, "bfloat16")
    assert needs.block_bytes == spec.bytes_per_block
    engine_config = draft_engine_config(config, 100, 1, 512)
    assert engine_config.num_kv_blocks == 100 + needs.extra_blocks
    assert draft_needs(EngineConfig(model=str(target)), torch.float32) is None


def test_on_the_split_platform_the_target_and_draft_engines_share_one_budget(split, monkeypatch):
    """A device share too small for a full pool: the target's pool, the draft engine's pool and
    the draft's weights together fit in it (the draft engine was given what was left before)."""
    monkeypatch.setattr(platform_module, "SPLIT_DEVICE_BYTES", 64 << 20)
    target, draft = str(make_tiny_model("llama")), str(make_tiny_model("qwen2", seed=3))
    options = dict(block_size=4, max_num_seqs=8, gpu_memory_utilization=0.05)  # a 3.2 MiB share
    llm = LLM(target, speculative_model=draft, num_speculative_tokens=4, **options)
    draft_engine = llm.engine.speculator.draft.engine
    needs = draft_needs(llm.engine.config, llm.engine.runner.dtype)
    pools = llm.engine.sizing.kv_pool_bytes + draft_engine.sizing.kv_pool_bytes
    assert draft_engine.kv_spec.num_blocks == llm.engine.kv_spec.num_blocks + needs.extra_blocks
    assert pools + needs.weight_bytes <= 0.05 * (64 << 20)
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(target, p, 6) for p in prompts]


def test_the_profile_run_executes_and_leaves_the_pool_untouched():
    path = make_tiny_model("llama")
    cfg = ModelConfig.from_path(path)
    spec = KVCacheSpec(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(cfg, EngineConfig(model=str(path), dtype="float32", block_size=4), spec)
    runner.profile(num_tokens=40, num_seqs=6, max_model_len=64)
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)


def test_the_largest_prefill_step_is_prompts_no_longer_than_the_context():
    assert largest_prefill(2048, 64, 512) == [512, 512, 512, 512]
    assert largest_prefill(2048, 3, 512) == [512, 512, 512]  # no more prompts than max_num_seqs
    assert largest_prefill(1000, 64, 512) == [512, 488]
    assert largest_prefill(256, 64, 8192) == [256]


def test_the_profile_run_of_a_budget_beyond_the_context_stays_inside_the_rotary_table():
    """The default budget (2048 tokens) on a model of 512 positions: profiled as four prompts of
    512, positions 0..511 (one prompt of 2048 raised here, and is a device-side assert on CUDA)."""
    path = make_tiny_model("llama")  # 512 positions
    cfg = ModelConfig.from_path(path)
    assert cfg.max_position_embeddings == 512
    spec = KVCacheSpec(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, "float32")
    runner = ModelRunner(cfg, EngineConfig(model=str(path), dtype="float32"), spec)
    steps = []
    runner.model.register_forward_pre_hook(
        lambda _m, args: steps.append((args[1].shape[0], int(args[1].max()), args[3].context_lens.tolist()))
    )
    runner.profile(num_tokens=2048, num_seqs=64, max_model_len=512)
    prefill, decode = steps
    assert prefill == (2048, 511, [512, 512, 512, 512])
    assert decode == (64, 511, [512] * 64)


def test_on_the_split_platform_an_engine_profiles_with_the_default_budget_and_is_exact(split, monkeypatch):
    """As on a GPU, the engine sizes its pool after the profile run: the default budget on a
    model of 512 positions starts, and its greedy tokens equal HF's."""
    path = str(make_tiny_model("llama"))
    profiled = []
    real_profile = ModelRunner.profile
    monkeypatch.setattr(ModelRunner, "profile", lambda self, *a: profiled.append(a) or real_profile(self, *a))
    llm = LLM(model=path)
    assert profiled == [(2048, llm.engine.config.max_num_seqs, 512)]
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(path, p, 6) for p in prompts]


def test_the_prefill_probe_seeds_the_speed_and_leaves_the_engine_as_it_was():
    """A node times a prompt before it serves (its first record has a prefill speed); the
    engine's pool, blocks, prefix cache and step counts are as a fresh engine's after it."""
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(make_tiny_model("llama")), num_kv_blocks=32, block_size=4))
    assert engine.stats().prefill_tokens_per_s is None
    speed = engine.warm_up()
    stats = engine.stats()
    assert stats.prefill_tokens_per_s == speed > 0
    assert (stats.num_blocks_free, stats.num_blocks_cached, stats.step_stats) == (32, 0, {})
    assert engine.block_manager.high_water == 0
    assert all(not k.any() and not v.any() for k, v in engine.runner.kv_caches)


def test_padded_decode_equals_unpadded_and_padding_writes_nothing():
    """The eager form of the CUDA graphs' decode (engine/executor/cuda_graphs.py) on the CPU: the same
    tokens as unpadded steps (and HF), and the same KV pool bit for bit."""
    path = str(make_tiny_model("llama"))
    prompts = _prompts()[:3]  # decode batches of 3: padded to 4
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    options = dict(
        num_kv_blocks=64, block_size=4, attention_backend="torch", max_num_seqs=6, max_model_len=80
    )
    plain, padded = LLM(model=path, **options), LLM(model=path, **options)
    padded.engine.runner.use_decode_graphs(6, 80, capture=False)
    sizes = []
    real_run = padded.engine.runner.graphs.run
    padded.engine.runner.graphs.run = lambda ids, *a: sizes.append(ids.shape[0]) or real_run(ids, *a)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in padded.generate(prompts, params)] == want
    assert want == [hf_greedy(path, p, 8) for p in prompts]
    assert 3 in sizes, sizes  # steps really ran padded
    for (k0, v0), (k1, v1) in zip(plain.engine.runner.kv_caches, padded.engine.runner.kv_caches, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.usefixtures("processes")
def test_a_prefill_decode_pair_on_the_split_platform_is_exact(tmp_path, monkeypatch):
    """Both nodes on the split platform (KV packed and landed through fake copy streams, inputs
    from poisoned host buffers): concurrent mixed prompts, with and without logprobs, through
    the prefill node and on the decode node alone, give HF's greedy tokens; a seeded sampled
    request gives the tokens the plain CPU engine draws."""
    from tests.cluster import Client, NodeProcess

    model = str(make_tiny_model("llama"))
    seeded = {"temperature": 0.9, "top_p": 0.9, "seed": 11, "max_tokens": 7, "ignore_eos": True}
    prompt = _prompts()[2]
    want_seeded = LLM(model=model, num_kv_blocks=64, block_size=8).generate(
        [prompt], SamplingParams(**seeded)
    )
    monkeypatch.setenv(TEST_PLATFORM_ENV, "split")
    extra = ["--block-size", "8", "--num-kv-blocks", "128"]
    nodes = [NodeProcess(role, model, tmp_path, None, extra) for role in ("prefill", "decode")]
    client = Client()
    try:
        prefill, decode = (n.wait_ready() for n in nodes)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (3, 40, 17, 90, 8, 61)]
        for i, p in enumerate(prompts):
            params = {
                "temperature": 0.0,
                "ignore_eos": True,
                "max_tokens": 3 + i,
                "logprobs": 2 if i % 2 else None,
            }
            client.generate(
                prefill if i < 4 else decode, f"g{i}", p, params, decode=decode if i < 4 else None
            )
        client.generate(prefill, "seeded", prompt, seeded, decode=decode)
        results = client.collect([f"g{i}" for i in range(len(prompts))] + ["seeded"])
        for i, p in enumerate(prompts):
            r = results[f"g{i}"]
            assert r["failed"] is None and r["tokens"] == hf_greedy(model, p, 3 + i), i
            logprobs = [lp for _, chunk in r["chunks"] for lp in chunk.logprobs]
            assert len(logprobs) == (len(r["tokens"]) if i % 2 else 0), i
        assert results["seeded"]["tokens"] == want_seeded[0].outputs[0].token_ids
        for node in (prefill, decode):
            info = client.wait_idle(node)
            assert info["num_blocks_free"] == info["num_blocks_total"]
    finally:
        client.close()
        for n in nodes:
            n.close()
