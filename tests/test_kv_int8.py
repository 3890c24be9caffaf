"""The int8 KV cache in memory (kernels/kv_int8.py, layout nbhd-q8-v1): its rows, its writes, and
attention over it in the C++ kernel and the torch path, against fp32 references on the same values."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_ext, kv_int8, ops, torch_fast
from pdserve.kernels.paged_prefill import paged_prefill_attention_ref
from pdserve.kernels.testing import query_start_loc, random_paged_kv


def test_rows_hold_values_within_half_a_step_and_their_scale_last():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    x[7, 1] = 0.0  # an all-zero row: scale 0, values 0, no division by zero
    rows = kv_int8.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 64 + kv_int8.SCALE_BYTES)
    scale = rows[..., 64:].contiguous().view(torch.float32)  # [50, 3, 1]
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = kv_int8.dequantize_rows(rows)
    assert (back - x).abs().le(scale / 2 + 1e-6).all()
    assert torch.equal(back[7, 1], torch.zeros(64)) and scale[7, 1].item() == 0.0
    assert rows[..., :64].abs().max().item() == 127  # each row's largest value maps to +-127


def test_a_write_never_changes_the_rows_before_it():
    # rows are quantized alone: a later token (a speculative draft, say) with a far larger value
    # leaves the block's earlier rows exactly as they were, so a rollback needs no rewrite
    key_cache = torch.zeros(4, 8, 2, 32 + kv_int8.SCALE_BYTES, dtype=torch.int8)
    value_cache = torch.zeros_like(key_cache)
    first = torch.randn(5, 2, 32)
    ops.write_kv_cache(first, first, key_cache, value_cache, torch.arange(8, 13))
    before = key_cache.clone()
    ops.write_kv_cache(first[:2] * 1000, first[:2], key_cache, value_cache, torch.tensor([13, -1]))
    assert torch.equal(key_cache.view(-1, 2, 36)[:13], before.view(-1, 2, 36)[:13])
    assert not torch.equal(key_cache.view(-1, 2, 36)[13], before.view(-1, 2, 36)[13])
    assert torch.equal(key_cache.view(-1, 2, 36)[14:], before.view(-1, 2, 36)[14:])  # slot -1: nowhere
    torch.testing.assert_close(
        kv_int8.dequantize_rows(key_cache.view(-1, 2, 36)[8:13]), first, atol=0.02, rtol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_writes_the_same_bytes_as_the_torch_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(40, 3, 64, generator=gen).to(dtype) * 3 for _ in range(2))
    key[5] = 0.0  # all-zero rows
    key[6, 0, 7] = 1e-30  # a denormal-range largest value
    slots = torch.randperm(8 * 16, generator=gen)[:40]
    slots[[3, 17]] = -1  # padded rows
    caches = [torch.zeros(8, 16, 3, 64 + kv_int8.SCALE_BYTES, dtype=torch.int8) for _ in range(4)]
    assert ops.native_cpu(key)
    ops.write_kv_cache(key, value, caches[0], caches[1], slots)  # the C++ op
    torch_fast.write_kv_cache(key, value, caches[2], caches[3], slots)  # torch
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].any()


def _int8_problem(seed, query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size=16):
    kv = random_paged_kv(context_lens, block_size, num_kv_heads, head_dim, seed=seed)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    k8, v8 = kv_int8.quantize_rows(kv.key_cache), kv_int8.quantize_rows(kv.value_cache)
    return query, kv, k8, v8, query_start_loc(query_lens)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (8, 1), (4, 4), (16, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (37, None), (None, 2.0)])
def test_kernel_reads_int8_rows_as_their_dequantized_values(
    num_heads, num_kv_heads, head_dim, window, softcap
):
    # decodes, a whole prompt, chunks over cached context, a context past one key chunk (128);
    # the reference runs on the dequantized fp32 cache, so only summation order may differ
    query_lens, context_lens = [1, 1, 1, 20, 7, 1], [1, 129, 700, 20, 300, 17]
    q, kv, k8, v8, qsl = _int8_problem(2, query_lens, context_lens, num_heads, num_kv_heads, head_dim)
    rest = (kv.block_tables, qsl, kv.context_lens, 0.15, window, softcap)
    assert cpu_ext.load() is not None
    out = cpu_ext.paged_attention(q, k8, v8, *rest)
    reference = paged_prefill_attention_ref(
        q, kv_int8.dequantize_rows(k8), kv_int8.dequantize_rows(v8), *rest
    )
    torch.testing.assert_close(out, reference, atol=2e-6, rtol=1e-5)
    exact = paged_prefill_attention_ref(q, kv.key_cache, kv.value_cache, *rest)
    assert (out - exact).abs().max().item() < 0.05  # and near the unquantized cache's result


def test_bf16_queries_read_an_int8_cache():
    q, kv, k8, v8, qsl = _int8_problem(3, [1, 1, 9], [40, 200, 30], 9, 3, 64)
    rest = (kv.block_tables, qsl, kv.context_lens, 0.125)
    out = cpu_ext.paged_attention(q.bfloat16(), k8, v8, *rest)
    assert out.dtype == torch.bfloat16
    reference = paged_prefill_attention_ref(
        q, kv_int8.dequantize_rows(k8), kv_int8.dequantize_rows(v8), *rest
    )
    torch.testing.assert_close(out.float(), reference, atol=1e-2, rtol=1e-2)


def test_torch_path_reads_int8_rows_like_the_kernel():
    q, kv, k8, v8, qsl = _int8_problem(4, [1, 1, 12], [33, 150, 12], 6, 2, 64)
    native = cpu_ext.paged_attention(q, k8, v8, kv.block_tables, qsl, kv.context_lens, 0.125)
    decode = ops.paged_decode_attention(
        q[:2], k8, v8, kv.block_tables[:2], kv.context_lens[:2], 0.125, backend="torch"
    )
    prefill = ops.paged_prefill_attention(
        q[2:], k8, v8, kv.block_tables[2:], qsl[2:] - 2, kv.context_lens[2:], 0.125, backend="torch"
    )
    torch.testing.assert_close(torch.cat([decode, prefill]), native, atol=2e-6, rtol=1e-5)


def test_cache_rows_of_the_wrong_width_are_a_clear_error():
    q, kv, k8, v8, qsl = _int8_problem(5, [1], [10], 4, 2, 32)
    with pytest.raises(RuntimeError, match="head_dim \\+ 4"):
        cpu_ext.paged_attention(
            q,
            k8[..., :32].contiguous(),
            v8[..., :32].contiguous(),
            kv.block_tables,
            qsl,
            kv.context_lens,
            0.1,
        )


def test_triton_refuses_an_int8_cache():
    q, kv, k8, v8, qsl = _int8_problem(6, [1], [10], 4, 2, 32)
    with pytest.raises(NotImplementedError, match="int8 KV cache"):
        ops.paged_decode_attention(q, k8, v8, kv.block_tables, kv.context_lens, 0.1, backend="triton")


def test_an_int8_spec_is_its_own_layout_at_about_a_quarter_of_fp32s_bytes():
    from pdserve.engine.config import EngineConfig
    from pdserve.protocol.fingerprint import KVFingerprint
    from pdserve.protocol.kv_layout import KVCacheSpec

    fp32 = KVCacheSpec(30, 100, 16, 3, 64, "float32")
    int8 = KVCacheSpec(30, 100, 16, 3, 64, "int8")
    assert int8.block_shape == (16, 3, 64 + kv_int8.SCALE_BYTES) and fp32.block_shape == (16, 3, 64)
    assert int8.bytes_per_block * 256 == fp32.bytes_per_block * 68  # 68 bytes a row against 256
    assert (int8.layout, fp32.layout) == ("nbhd-q8-v1", "nbhd-v1")
    a, b = (KVFingerprint.from_spec("m", s, s.layout) for s in (fp32, int8))
    assert a.first_difference(b) == "dtype" and b.row_width == 68  # never paired with an fp32 node
    assert EngineConfig(model="m", kv_cache_dtype="int8", dtype="float32").kv_dtype == "int8"
    assert EngineConfig(model="m", dtype="bfloat16").kv_dtype == "bfloat16"
    from pdserve.engine.llm_engine import LLMEngine
    from tests.tiny_models import make_tiny_model

    with pytest.raises(ValueError, match="CPU kernels only"):  # before any allocation
        LLMEngine(
            EngineConfig(
                model=str(make_tiny_model("llama")), kv_cache_dtype="int8", attention_backend="triton"
            )
        )
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8")


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2", "qwen3", "gpt2"])
def test_engine_on_an_int8_cache_stays_near_hf_fp32(kind):
    # windows (mistral), soft-capping (gemma2), head_dim 32 (qwen3), MHA with biases (gpt2):
    # teacher-forced through the engine, chunked (a 24-token budget), every row reads its context
    # from int8 rows; a wrong row stride or a lost scale would be off by whole nats, not hundredths
    from pdserve.engine import LLM, SamplingParams
    from tests.engine_helpers import hf_logits
    from tests.tiny_models import make_tiny_model

    path = str(make_tiny_model(kind))
    rng = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=rng).tolist() for n in (9, 40, 130)]
    llm = LLM(path, kv_cache_dtype="int8", num_kv_blocks=64, block_size=8, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    for prompt, out in zip(prompts, outs, strict=True):
        logp = torch.log_softmax(hf_logits(path, prompt)[:-1], -1)
        want = logp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        got = torch.tensor([lp.logprob for lp in out.prompt_logprobs])
        assert (got - want).abs().max().item() < 0.1, (kind, len(prompt))
