"""The router end to end: ``pdserve router`` + 1 prefill + 1 decode node + redis-server, tiny model
with the default model's tokenizer, driven by the official openai client."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
import time

import httpx
import openai
import pytest

from pdserve.protocol.cluster_key import write_new_key
from tests import forkserver, web
from tests.cluster import ROOT, NodeProcess, RedisServer, free_port
from tests.engine_helpers import hf_greedy

pytestmark = pytest.mark.usefixtures("processes")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LONG_PROMPT = "Once upon a time, in a quiet village by the sea, there lived an old fisherman who"


def tiny_model_with_tokenizer(
    default_model_dir: pathlib.Path, max_position_embeddings: int = 512
) -> pathlib.Path:
    """A seeded 2-layer Llama with the default model's vocabulary, tokenizer and chat template."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    digest = hashlib.sha256(config.to_json_string().encode()).hexdigest()[:12]
    path = pathlib.Path(tempfile.gettempdir()) / f"pdserve-tiny-models-{os.getuid()}" / f"llama-tok-{digest}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, tmp / name)
    if path.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, path)
    return path


class RouterProcess:
    def __init__(self, model: pathlib.Path, redis_url: str, tmp: pathlib.Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.log_path = tmp / f"router-{self.port}.log"
        self._log = open(self.log_path, "w")
        args = [
            "router",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--redis",
            redis_url,
            "--poll-interval-s",
            "0.2",
            *extra,
        ]
        # forked from a server that made the router's imports once (tests/forkserver.py)
        self.proc = forkserver.spawn(
            args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, log=self._log
        )

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until the router serves through a prefill/decode pair ("ok"; a decode node alone makes
        it healthy too, as "decode_only")."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{self.log_path.read_text()}")
            try:
                health = web.get(self.url + "/health", timeout=1)
                if health.status_code == 200 and health.json()["status"] == "ok":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router not healthy:\n{self.log_path.read_text()}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()


@contextlib.contextmanager
def serving(redis: RedisServer | None, nodes, routers, start_timeout_s: float = 60.0):
    """Until every node is ready and every router healthy; on the way out, close them all and Redis
    (None: the processes run on a Redis that someone else stops)."""
    try:
        for node in nodes:
            node.wait_ready(start_timeout_s)
        for router in routers:
            router.wait_healthy(start_timeout_s)
        yield
    finally:
        for process in [*routers, *nodes]:
            process.close()
        if redis is not None:
            redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("router-cluster")
    # 2048 positions: a request can decode for long enough that only an abort ends it early.
    model = tiny_model_with_tokenizer(default_model_dir, max_position_embeddings=2048)
    redis = RedisServer(tmp)
    write_new_key(tmp / "cluster.key")  # a keyed cluster: signed records, CURVE on every socket
    key = ["--cluster-key-file", str(tmp / "cluster.key")]
    extra = ["--num-kv-blocks", "160", "--heartbeat-interval", "0.2", "--heartbeat-ttl", "2", *key]
    nodes = [NodeProcess(role, str(model), tmp, redis.url, extra) for role in ("prefill", "decode")]
    router = RouterProcess(model, redis.url, tmp, "--disagg-threshold", "8", *key)
    with serving(redis, nodes, [router]):
        yield model, router, nodes


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_greedy_completion_equals_hf_and_streaming_equals_whole(cluster, default_model_dir):
    model, router, nodes = cluster
    client = _client(router)
    whole = client.completions.create(model=model.name, prompt=LONG_PROMPT, max_tokens=8, **GREEDY)
    parts = list(
        client.completions.create(
            model=model.name,
            prompt=LONG_PROMPT,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    from pdserve.router.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    prompt_ids = tokenizer.encode(LONG_PROMPT)
    assert whole.choices[0].text == tokenizer.decode(hf_greedy(str(model), prompt_ids, 8))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 8
    assert parts[-1].usage.completion_tokens == 8
    # The first went through the prefill node; the repeat, cached on the decode node, may skip it.
    assert len(nodes[0].events("request_added")) >= 1


def test_chat_streaming_equals_whole(cluster):
    model, router, _ = cluster
    client = _client(router)
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    whole = client.chat.completions.create(model=model.name, messages=messages, max_tokens=6, **GREEDY)
    parts = list(
        client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=6, stream=True, **GREEDY
        )
    )
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        == whole.choices[0].message.content
    )
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6


def test_seeded_samples_are_reproducible_and_n_gives_n_choices(cluster):
    model, router, _ = cluster
    client = _client(router)
    kwargs = dict(model=model.name, prompt=LONG_PROMPT, max_tokens=6, n=2, seed=123, temperature=1.0)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage.completion_tokens == 12


def test_logprobs_and_stop_strings(cluster):
    model, router, _ = cluster
    client = _client(router)
    done = client.completions.create(model=model.name, prompt=LONG_PROMPT, max_tokens=5, logprobs=2, **GREEDY)
    logprobs = done.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert "".join(logprobs.tokens) == done.choices[0].text
    text = (
        client.completions.create(model=model.name, prompt=LONG_PROMPT, max_tokens=12, **GREEDY)
        .choices[0]
        .text
    )
    stop = text[3:6]
    cut = client.completions.create(
        model=model.name, prompt=LONG_PROMPT, max_tokens=12, stop=[stop], **GREEDY
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_repeated_prompt_reports_cached_tokens(cluster):
    model, router, _ = cluster
    client = _client(router)
    system = "You are a terse assistant. " * 6
    first = client.chat.completions.create(
        model=model.name,
        max_tokens=2,
        **GREEDY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hello"}],
    )
    second = client.chat.completions.create(
        model=model.name,
        max_tokens=2,
        **GREEDY,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Goodbye"}],
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0 or first.usage.prompt_tokens > 16
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def _used_blocks(router, computed_after: float = 0.0) -> dict[str, int]:
    """KV blocks in use per node, from /metrics; a node whose status there was computed before
    ``computed_after`` (the registry lags by a heartbeat) is left out."""
    text = web.get(router.url + "/metrics").text
    labels = r'\{node_id="([^"]+)",role="\w+"\} '
    used = {m[1]: int(m[2]) for m in re.finditer("pdserve_node_kv_blocks_used" + labels + r"(\d+)", text)}
    at = {
        m[1]: float(m[2])
        for m in re.finditer("pdserve_node_status_timestamp_seconds" + labels + r"(\S+)", text)
    }
    return {node: num for node, num in used.items() if at.get(node, 0.0) > computed_after}


def wait_blocks_freed(router, after: float, num_nodes: int = 2, timeout_s: float = 15.0) -> dict[str, int]:
    """Blocks in use per node, once every node's status computed after ``after`` shows none (or
    the deadline passes): the registry lags by a heartbeat, which a loaded machine stretches."""
    deadline = time.monotonic() + timeout_s
    used = _used_blocks(router, computed_after=after)
    while time.monotonic() < deadline and (len(used) < num_nodes or any(used.values())):
        time.sleep(0.1)
        used = _used_blocks(router, computed_after=after)
    return used


def test_client_disconnect_frees_the_blocks(cluster):
    model, router, nodes = cluster
    ids = []

    async def stream_then_leave():
        async with httpx.AsyncClient(timeout=60) as http:
            body = {
                "model": model.name,
                "prompt": LONG_PROMPT,
                "max_tokens": 2000,  # seconds of decoding: the abort must be what ends it
                "stream": True,
                "ignore_eos": True,
            }
            async with http.stream("POST", router.url + "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: "):
                        ids.append(json.loads(line[6:])["id"])
                    if len(ids) == 3:
                        break

    asyncio.run(stream_then_leave())
    left_at = time.time()
    used = wait_blocks_freed(router, after=left_at)  # statuses both nodes computed after the client left
    decode_log = next(n for n in nodes if n.role == "decode").log()
    node_request = f'"request_id": "{ids[0]}-0"'
    events = [json.loads(line)["event"] for line in decode_log.splitlines() if node_request in line]
    if len(used) < 2 or any(used.values()) or "request_aborted" not in events:
        # pytest shortens a long assertion message: the logs go to stdout whole.
        print(f"client left at {left_at}\n--- router log ---\n{router.log_path.read_text()[-6000:]}")
        for node in nodes:
            print(f"--- {node.role} log ---\n{node.log()[-6000:]}")
    assert len(used) == 2 and not any(used.values()), used
    assert "request_aborted" in events and "request_finished" not in events, events


def test_a_burst_past_the_ttft_slo_is_shed_with_429_and_what_is_admitted_stays_exact(cluster, tmp_path):
    """A router with --ttft-slo-s at 5 prompts' worth of the prefill node's measured speed (room
    for that speed to move by 2x either way on a loaded machine before the burst), and 16 long
    prompts at once: the first ones are admitted and exact; those whose predicted first
    token would come later are shed at once with 429, Retry-After and an OpenAI-shaped error,
    counted on /metrics; and the nodes hold no block after."""
    import concurrent.futures

    from pdserve.router.tokenizer import Tokenizer

    model, router, nodes = cluster
    tokenizer = Tokenizer(model)
    prompt = LONG_PROMPT + " and the sea" * 30
    num_tokens = len(tokenizer.encode(prompt))
    _client(router).completions.create(model=model.name, prompt=prompt, max_tokens=2, **GREEDY)  # a speed
    deadline = time.monotonic() + 10
    speed = None
    while speed is None and time.monotonic() < deadline:
        found = re.search(
            r'pdserve_node_prefill_tokens_per_second\{node_id="[^"]+",role="prefill"\} (\S+)',
            web.get(router.url + "/metrics").text,
        )
        speed = float(found[1]) if found else time.sleep(0.1)
    assert speed, "the prefill node reported no speed"
    slo = 5 * num_tokens / speed
    shedding = RouterProcess(model, nodes[0].redis_url, tmp_path, *router.extra, "--ttft-slo-s", f"{slo:.6f}")
    try:
        shedding.wait_healthy()
        body = {"model": model.name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}

        def send(i: int) -> httpx.Response:
            return web.post(shedding.url + "/v1/completions", json={**body, "stream": i % 2 == 1}, timeout=60)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(send, range(16)))
        ok = [r for r in replies if r.status_code == 200]
        shed = [r for r in replies if r.status_code == 429]
        assert len(ok) + len(shed) == 16 and ok and shed, [r.status_code for r in replies]
        expected = tokenizer.decode(hf_greedy(str(model), tokenizer.encode(prompt), 4))
        for reply in ok:
            if reply.headers["content-type"].startswith("text/event-stream"):
                events = [
                    json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")
                ]
                assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected
            else:
                assert reply.json()["choices"][0]["text"] == expected
        for reply in shed:
            assert int(reply.headers["retry-after"]) >= 1
            error = reply.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
            assert "beyond the" in error["message"] and "TTFT SLO" in error["message"]
        scraped = web.get(shedding.url + "/metrics").text
        assert f'pdserve_shed_total{{reason="ttft_slo"}} {float(len(shed))}' in scraped
    finally:
        shedding.close()
    used = wait_blocks_freed(router, after=time.time())
    assert len(used) == 2 and not any(used.values()), used
