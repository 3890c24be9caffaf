"""The model forward of every family is device-clean and graph-safe: it runs on ``meta``.

Meta tensors have shapes but no data, so two faults that would show only on a GPU fail here, on
the CPU: a non-scalar host tensor mixed with device tensors (a factory without ``device=``)
raises, and so does any host sync (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``), which a
CUDA graph cannot capture. The kernels' meta fakes (kernels/ops.py) stand in for the KV
write and the attention. The model is built as engine/executor/model_runner.py builds it, from the tiny
configs alone (no weights), in the CUDA default dtype. GPU_PLAN.md section 3, "Meta forward".
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from pdserve.engine.config import ModelConfig
from pdserve.engine.executor.attention import AttentionMetadata
from pdserve.engine.models import model_class
from pdserve.kernels import ops
from tests.tiny_families import FAMILY_CONFIGS
from tests.tiny_models import CONFIGS

KINDS = {**CONFIGS, **FAMILY_CONFIGS}
HOST_ROUTING = pytest.mark.xfail(
    raises=(NotImplementedError, RuntimeError),
    strict=True,
    reason="MoE routes on the host (moe.py): stays eager, no CUDA graphs",
)
MOE_KINDS = {"qwen2_moe", "mixtral"}  # drop a kind here the day its routing stays on the device

# The batch: 3 decode rows (one token each), then one prefill chunk of 5 tokens; meta tensors
# carry shapes only, so there are no token ids, slots or lengths to choose.
#   rows: [ d0 d1 d2 | p p p p p ]
DECODES, CHUNK = 3, 5
NUM_SEQS, NUM_TOKENS = DECODES + 1, DECODES + CHUNK
NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 16, 4, 4
DTYPE = torch.bfloat16  # engine.device.resolve_dtype's choice on CUDA


def _meta(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _model_config(kind: str) -> ModelConfig:
    hf = KINDS[kind]()
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf.model_type]  # what save_pretrained would record
    return ModelConfig.from_dict(f"<{kind}>", {**hf.to_dict(), "architectures": [arch]})


def _meta_model(cfg: ModelConfig) -> nn.Module:
    with torch.device("meta"):  # parameters and rotary tables on meta; nothing is allocated
        model = model_class(cfg)(cfg, cfg.max_position_embeddings)
    return model.to(DTYPE).eval()


def _meta_batch() -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=_meta(NUM_TOKENS, dtype=torch.int64),
        num_decode_tokens=DECODES,
        decode_block_tables=_meta(DECODES, MAX_BLOCKS),
        decode_context_lens=_meta(DECODES),
        prefill_block_tables=_meta(1, MAX_BLOCKS),
        prefill_query_start_loc=_meta(2),
        prefill_context_lens=_meta(1),
        block_tables=_meta(NUM_SEQS, MAX_BLOCKS),
        query_start_loc=_meta(NUM_SEQS + 1),
        context_lens=_meta(NUM_SEQS),
    )


def _forward_on_meta(model: nn.Module, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, logits) of one mixed batch, run outside the meta default device, so that a factory
    without ``device=`` inside the forward builds a host tensor (and fails)."""
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    kv_caches = [
        (_meta(*cache_shape, dtype=DTYPE), _meta(*cache_shape, dtype=DTYPE)) for _ in range(cfg.num_layers)
    ]
    input_ids, positions = _meta(NUM_TOKENS, dtype=torch.int64), _meta(NUM_TOKENS, dtype=torch.int64)
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_caches, _meta_batch())
        return hidden, model.compute_logits(hidden)


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=HOST_ROUTING) if k in MOE_KINDS else k for k in KINDS]
)
def test_forward_runs_on_meta_without_host_tensors_or_syncs(kind):
    cfg = _model_config(kind)
    hidden, logits = _forward_on_meta(_meta_model(cfg), cfg)
    assert (hidden.device.type, hidden.shape, hidden.dtype) == ("meta", (NUM_TOKENS, cfg.hidden_size), DTYPE)
    assert (logits.device.type, logits.shape, logits.dtype) == (
        "meta",
        (NUM_TOKENS, cfg.vocab_size),
        torch.float32,
    )


LEAKS = {  # what the harness must catch, injected after the first layer's MLP
    "a host tensor": (lambda out: out + torch.arange(out.shape[-1]), "not on the expected device meta"),
    "a .tolist() sync": (lambda out: out * len(out[0].tolist()), "Cannot copy out of meta tensor"),
    "an int(t) sync": (lambda out: out * int(out[0, 0]), r"item\(\) cannot be called on meta"),
    "a bool(t) branch": (lambda out: out if out[0, 0] > 0 else -out, r"item\(\) cannot be called on meta"),
}


@pytest.mark.parametrize("leak", LEAKS)
def test_the_harness_fails_a_forward_that_leaks(leak):
    fault, message = LEAKS[leak]
    cfg = _model_config("llama")
    model = _meta_model(cfg)
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: fault(out))
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        _forward_on_meta(model, cfg)


def test_the_meta_fakes_assert_devices_as_the_kernels_do():
    # A host slot_mapping beside meta caches would read host memory from the device.
    key, caches = _meta(2, 2, 16, dtype=DTYPE), [_meta(4, 8, 2, 16, dtype=DTYPE) for _ in range(2)]
    with pytest.raises(AssertionError, match="slot_mapping is on cpu"):
        ops.write_kv_cache(key, key, *caches, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(AssertionError, match="context_lens is on cpu"):
        ops.paged_decode_attention(
            key.repeat(1, 2, 1), *caches, _meta(2, 1), torch.ones(2, dtype=torch.int32), 1.0
        )
