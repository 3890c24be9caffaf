"""`pdserve up` in a subprocess on a tiny model with the default model's vocabulary: what the
launcher tests (tests/test_up.py) and other end-to-end suites start."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import torch
import transformers

from tests import web
from tests.cluster import ROOT, free_port
from tests.tiny_models import TINY

NODE_ARGS = "--block-size 8 --num-kv-blocks 256"
FILLER = " ".join(f"word{k}" for k in range(40))  # long enough that prompts go prefill -> decode


def tiny_model_with_tokenizer(default_model_dir: pathlib.Path, root: pathlib.Path) -> pathlib.Path:
    """A tiny random Llama whose vocabulary is the default model's, with its tokenizer files:
    the router tokenizes real text and the nodes run in milliseconds."""
    path = root / "tiny-llama-smollm2-vocab"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY, "vocab_size": 49152})
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, path / name)
    return path


class Launcher:
    """`pdserve up` in a subprocess, its output in a file."""

    def __init__(
        self,
        tmp: pathlib.Path,
        model: pathlib.Path,
        *flags: str,
        node_args: str = NODE_ARGS,
        host: str = "127.0.0.1",  # the router's (its HTTP and reply ports)
    ) -> None:
        self.port = free_port()
        self.log_dir = tmp / "logs"
        self.out_path = tmp / "up.out"
        self._out = open(self.out_path, "w")
        cmd = [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--log-dir",
            str(self.log_dir),
            "--node-args",
            node_args,
            "--host",
            host,
            "--stop-timeout",
            "10",
            *flags,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{self.port}"

    def output(self) -> str:
        return self.out_path.read_text()

    def wait_up(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve is up" not in self.output():
            assert self.proc.poll() is None and time.monotonic() < deadline, (
                f"launch failed:\n{self.output()}"
            )
            time.sleep(0.1)

    def redis_url(self) -> str:
        return re.search(r"registry: (redis://\S+)", self.output()).group(1)

    def events(self, child: str, name: str) -> list[dict]:
        lines = (self.log_dir / f"{child}.log").read_text().splitlines()
        return [
            r for r in (json.loads(line) for line in lines if line.startswith("{")) if r.get("event") == name
        ]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


def completion_text(url: str, body: dict, stream: bool) -> str:
    """One /v1/completions request, whole or streamed; its text (asserting a 200)."""
    if not stream:
        reply = web.post(url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]
    text = []
    with web.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)
