"""KV transfer time between tensor-parallel layouts, side by side on this machine.

    python -m bench.tp_transfer [--tokens 1024] [--rounds 3]

Prefill and decode nodes at tp 1 and 2 (real processes with their worker ranks, one thread a
rank) on bench/tp_steps.py's SmolLM2-135M-shaped model. For each pairing P tp -> D tp, each round
sends a fresh prompt of ``--tokens`` tokens through P to D and reads the prefill node's
``kv_shipped`` record: the path (single-rank pairs on one host take the one-copy memfd path,
a tensor-parallel node's KV the staging ring), the bytes moved and the transfer's seconds. The
1 -> 1 pairing is the baseline the others are read against.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile

import torch

from bench.tp_steps import make_model
from tests.cluster import Client, NodeProcess

ARGS = ["--block-size", "16", "--num-kv-blocks", "512", "--max-num-batched-tokens", "2048"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        model = make_model(root / "model")
        nodes = {
            (role, tp): NodeProcess(role, model, root, None, [*ARGS, "--tensor-parallel-size", str(tp)])
            for role in ("prefill", "decode")
            for tp in (1, 2)
        }
        client = Client()
        try:
            addrs = {key: node.wait_ready(timeout_s=300) for key, node in nodes.items()}
            g = torch.Generator().manual_seed(0)
            rows = []
            for p, d in ((1, 1), (2, 1), (1, 2), (2, 2)):
                seconds, sizes, paths = [], [], set()
                for r in range(args.rounds + 1):  # the first round warms up
                    rid = f"{p}{d}-{r}"
                    prompt = torch.randint(5, 40000, (args.tokens,), generator=g).tolist()
                    params = {"temperature": 0.0, "max_tokens": 2, "ignore_eos": True}
                    client.generate(addrs[("prefill", p)], rid, prompt, params, decode=addrs[("decode", d)])
                    client.collect([rid], timeout_s=300)
                    shipped = [
                        e for e in nodes[("prefill", p)].events("kv_shipped") if e["request_id"] == rid
                    ]
                    if r:
                        seconds.append(shipped[0]["seconds"])
                        sizes.append(shipped[0]["bytes"])
                        paths.add(
                            "one-copy" if shipped[0]["direct"] else "ring" if shipped[0]["shm"] else "socket"
                        )
                rows.append((p, d, statistics.median(seconds), sizes[0], "/".join(sorted(paths))))
        finally:
            client.close()
            for node in nodes.values():
                node.close()
    base = rows[0][2]
    print(f"| P tp -> D tp | path | bytes moved | transfer (median of {args.rounds}) | against 1 -> 1 |")
    print("|---|---|---|---|---|")
    for p, d, secs, size, path in rows:
        print(f"| {p} -> {d} | {path} | {size / 1e6:.1f} MB | {secs * 1e3:.1f} ms | {secs / base:.2f}x |")


if __name__ == "__main__":
    main()
