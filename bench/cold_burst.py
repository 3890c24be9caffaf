"""A burst of concurrent chat requests at a cluster that has just come up: how many the router
sheds (429) before any node has served a prompt. Start the cluster first, e.g.

    .venv/bin/python -m pdserve up --autoscale --port 8125
    .venv/bin/python bench/cold_burst.py --url http://127.0.0.1:8125

Prompts of 5-250 words, 8-64 tokens out, greedy; one line per request (status, seconds, the
start of the answer or of the error), then the count of 429s."""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import httpx

WORDS = "the quick brown fox jumps over the lazy dog and then some more words follow here".split()


def one(url: str, model: str, i: int) -> tuple[int, float, str]:
    text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range((5, 40, 120, 250)[i % 4]))
    body = {
        "model": model,
        "max_tokens": (8, 32, 64)[i % 3],
        "messages": [{"role": "user", "content": f"Summarize: {text}"}],
        "temperature": 0,
    }
    start = time.monotonic()
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    seconds = round(time.monotonic() - start, 2)
    if reply.status_code == 200:
        return 200, seconds, reply.json()["choices"][0]["message"]["content"][:40]
    return reply.status_code, seconds, reply.text[:150]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args()
    with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
        results = list(pool.map(lambda i: one(args.url, args.model, i), range(args.requests)))
    for result in results:
        print(result)
    print(f"429s: {sum(status == 429 for status, _, _ in results)} of {len(results)}")


if __name__ == "__main__":
    main()
