"""The router's LoRA surface (router/lora.py) over fake nodes: /v1/models lists the adapters with
their base model as parent, requests that name one carry it (and where to read it) to nodes whose
slots hold its rank only, the runtime load/unload endpoints, and their errors in OpenAI's shape."""

from __future__ import annotations

import json
import pathlib

import httpx
import pytest

from pdserve.router.tokenizer import Tokenizer
from tests.test_router_support import LONG_PROMPT, TEXT, FakeNode, fake_cluster, run_async


def _adapter(root: pathlib.Path, name: str, rank: int) -> str:
    folder = root / name
    folder.mkdir()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture
def adapters(tmp_path) -> dict[str, str]:
    return {"small": _adapter(tmp_path, "small", 8), "big": _adapter(tmp_path, "big", 64)}


def _nodes(tokens) -> list[FakeNode]:
    return [
        FakeNode("p0", "prefill", tokens, max_lora_rank=16),
        FakeNode("d-off", "decode", tokens, num_blocks_free=100),  # no LoRA
        FakeNode("d-small", "decode", tokens, max_lora_rank=16, num_blocks_free=60),
        FakeNode("d-big", "decode", tokens, max_lora_rank=64, num_blocks_free=50, adapters=("big",)),
    ]


def test_models_adapters_routing_and_runtime_load_and_unload(default_model_dir, adapters, tmp_path):
    tokens = Tokenizer(default_model_dir).encode(TEXT)
    nodes = _nodes(tokens)
    base = pathlib.Path(default_model_dir).name
    modules = tuple(f"{name}={path}" for name, path in adapters.items())

    async def go() -> None:
        async with fake_cluster(default_model_dir, nodes, lora_modules=modules) as cluster:
            async with httpx.AsyncClient(base_url=cluster.base_url, timeout=30) as http:
                models = (await http.get("/v1/models")).json()["data"]
                assert [(m["id"], m["parent"]) for m in models] == [
                    (base, None),
                    ("small", base),
                    ("big", base),
                ]
                assert models[1]["root"] == adapters["small"]

                def body(model: str, prompt: str = "Hi") -> dict:
                    return {"model": model, "prompt": prompt, "max_tokens": 2}

                for model, prompt, node_id in (
                    ("small", "Hi", "d-small"),  # d-off has more room but no LoRA
                    ("big", "Hi", "d-big"),  # the one node whose slots hold r=64
                    (base, "Hi", "d-off"),  # the base model goes where there is most room
                    ("small", LONG_PROMPT, "d-small"),  # through the prefill node, which holds r=16
                ):
                    before = {n.info.node_id: len(n.received) for n in nodes}
                    reply = await http.post("/v1/completions", json=body(model, prompt))
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["model"] == model
                    ((receiver, sent),) = [
                        (n, r) for n in nodes for r in n.received[before[n.info.node_id] :]
                    ]
                    decode = {n.info.kv_addr: n.info.node_id for n in nodes if n.info.kv_addr}.get(
                        sent.decode_addr
                    )
                    assert node_id == (decode or receiver.info.node_id), sent
                    assert not sent.request_id.endswith(".r1")  # no node refused it
                    params = sent.sampling_params
                    expected = (None, None) if model == base else (model, adapters[model])
                    assert (params.adapter, params.adapter_path) == expected

                missing = (await http.post("/v1/completions", json=body("nope"))).json()["error"]
                assert (missing["code"], missing["param"]) == ("model_not_found", "model")

                huge = _adapter(tmp_path, "huge", 128)  # no node holds r=128
                added = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": huge}
                )
                assert added.status_code == 200 and "huge" in added.text
                assert (await http.post("/v1/completions", json=body("huge"))).status_code == 503
                again = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "huge", "lora_path": huge}
                )
                assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
                bad = {"lora_name": "x", "lora_path": str(tmp_path / "absent")}
                refused = (await http.post("/v1/load_lora_adapter", json=bad)).json()["error"]
                assert refused["param"] == "lora_path"
                dora = _adapter(tmp_path, "dora", 8)
                config = json.loads((pathlib.Path(dora) / "adapter_config.json").read_text()) | {
                    "use_dora": True
                }
                (pathlib.Path(dora) / "adapter_config.json").write_text(json.dumps(config))
                refused = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "dora", "lora_path": dora}
                )
                assert refused.status_code == 400 and "use_dora" in refused.json()["error"]["message"]
                assert (
                    await http.post("/v1/unload_lora_adapter", json={"lora_name": "huge"})
                ).status_code == 200
                assert (await http.post("/v1/completions", json=body("huge"))).status_code == 404
                gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "huge"})
                assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
                assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [
                    base,
                    "small",
                    "big",
                ]
                scrape = (await http.get("/metrics")).text
                assert 'pdserve_lora_requests_total{adapter="small"} 2.0' in scrape

    run_async(go())


def test_a_bad_lora_modules_entry_stops_the_router(default_model_dir):
    from pdserve.router.lora import AdapterTable

    with pytest.raises(ValueError, match="NAME=PEFT_FOLDER"):
        AdapterTable(("base",), ("no-equals-sign",))
