"""Offline throughput on a CUDA GPU: pdserve ``LLM.generate`` against Hugging Face ``generate``, bf16.

A random-weight Llama of about 1.1B parameters (hidden 2048, 16 layers, 32 query / 8 KV heads,
intermediate 8192, vocab 32000) is built on the device, saved to a temporary folder, and both
sides generate for the same random prompts (128 prompts x 128 tokens in, 128 out by default;
greedy, EOS ignored, so every request makes exactly its output length). HF runs static batches
at each size in --hf-batch-sizes, after a warm-up at that size; its best counts. pdserve runs
``LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=...)`` after one warm-up request.
Throughput is output tokens / wall time of the whole workload, prefill included.

    python bench/gpu_offline.py                  # about a minute on an H200
    python bench/gpu_offline.py --skip-pdserve   # HF's baseline only (the engine row reads n/a)
    python bench/gpu_offline.py --smoke          # a tiny model on the CPU: checks the script, times nothing

Exit 0 when both sides ran (or pdserve was skipped), 1 when pdserve failed (its row reads n/a),
3 without a CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import shutil
import sys
import tempfile
import time
import traceback

import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # the checkout's engine

MODEL_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=4096,
)
MODEL_SMOKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
)


def build_model(shape: dict, device: str, dtype: torch.dtype, folder: pathlib.Path):
    """A seeded random Llama built directly on ``device``, saved to ``folder`` for pdserve."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None  # fixed-length outputs, like ignore_eos
    return model


def random_prompts(num: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (num, length), generator=g).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_tokens_per_s(model, prompts: list[list[int]], output_len: int, batch: int, device: str) -> float:
    """HF generate in static batches of ``batch`` (all prompts have one length: no padding)."""

    def run(rows: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(rows, device=device)  # [batch, input_len]
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape == (len(rows), ids.shape[1] + new_tokens)

    run(prompts[:batch], 4)  # warm-up at this batch size: cuBLAS handles, kernel choices
    sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        run(prompts[i : i + batch], output_len)
    sync(device)
    return len(prompts) * output_len / (time.perf_counter() - start)


def pdserve_tokens_per_s(folder: pathlib.Path, prompts, output_len: int, engine_options: dict) -> float:
    from pdserve.engine import LLM, SamplingParams  # here: --skip-pdserve needs no engine (nor llguidance)

    llm = LLM(str(folder), **engine_options)
    llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)  # returns host token ids: the device work is done
    elapsed = time.perf_counter() - start
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    assert made == len(prompts) * output_len, made
    return made / elapsed


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", default="32,64,128", help="comma-separated; the best counts")
    ap.add_argument("--max-num-seqs", type=int, default=128, help="pdserve's batch bound (its default is 64)")
    ap.add_argument("--skip-pdserve", action="store_true", help="HF only (the engine does not run on CUDA)")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 4 short prompts, on the CPU in fp32")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if args.smoke:
        shape, device, dtype = MODEL_SMOKE, "cpu", "float32"
        args.num_prompts, args.input_len, args.output_len, args.hf_batch_sizes = 4, 8, 8, "2,4"
        engine_options = dict(device=device, dtype=dtype, max_num_seqs=4, num_kv_blocks=32)
    elif not torch.cuda.is_available():
        print("gpu_offline: torch sees no CUDA device; --smoke runs a tiny model on the CPU")
        return 3
    else:
        shape, device, dtype = MODEL_1B, "cuda", "bfloat16"
        engine_options = dict(device=device, dtype=dtype, max_num_seqs=args.max_num_seqs)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="pdserve-gpu-offline-"))
    try:
        return run(args, shape, device, dtype, folder, engine_options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run(args, shape: dict, device: str, dtype: str, folder: pathlib.Path, engine_options: dict) -> int:
    start = time.perf_counter()
    model = build_model(shape, device, getattr(torch, dtype), folder)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: random Llama, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
        f"{shape['num_attention_heads']}/{shape['num_key_value_heads']} heads, vocab {shape['vocab_size']}: "
        f"{num_params:,} parameters, {dtype} on {device}, built and saved in "
        f"{time.perf_counter() - start:.1f} s",
        flush=True,
    )
    prompts = random_prompts(args.num_prompts, args.input_len, shape["vocab_size"])
    print(
        f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out "
        "(greedy, EOS ignored)",
        flush=True,
    )
    hf = {}
    for batch in (int(b) for b in args.hf_batch_sizes.split(",")):
        hf[batch] = hf_tokens_per_s(model, prompts, args.output_len, batch, device)
        print(f"hf batch {batch}: {hf[batch]:.1f} tok/s", flush=True)
    best = max(hf, key=hf.get)
    print(f"hf best: {hf[best]:.1f} tok/s at batch {best}", flush=True)
    del model  # the engine loads its own copy from the folder
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    if args.skip_pdserve:
        print("pdserve: n/a (skipped: --skip-pdserve)")
        print("ratio pdserve/hf: n/a")
        return 0
    try:
        ours = pdserve_tokens_per_s(folder, prompts, args.output_len, engine_options)
    except Exception as e:  # the engine on CUDA is new: report, keep HF's figures
        traceback.print_exc()
        print(f"pdserve: n/a ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        print("ratio pdserve/hf: n/a")
        return 1
    print(f"pdserve: {ours:.1f} tok/s (max_num_seqs {engine_options['max_num_seqs']})")
    print(f"ratio pdserve/hf: {ours / hf[best]:.2f}x (target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
