"""The KV fingerprint names a model by content: equal for copies of one folder under other names,
different for another checkpoint of the same shape; the router refuses nodes of another model."""

from __future__ import annotations

import dataclasses
import shutil

from pdserve.protocol.model_digest import model_digest
from pdserve.router.node_client import NodeClient
from pdserve.router.registry_client import NodeRegistry
from tests.test_router_support import FINGERPRINT, node_info
from tests.tiny_models import make_tiny_model


def test_a_copy_under_another_name_has_the_same_digest_and_other_weights_do_not(tmp_path):
    original = make_tiny_model("llama")
    copy = tmp_path / "renamed"
    shutil.copytree(original, copy)
    assert model_digest(copy) == model_digest(original)
    other = make_tiny_model("qwen2")
    assert model_digest(other) != model_digest(original)
    tensor_file = next(copy.glob("*.safetensors"))
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0xFF  # same shapes and names, one weight byte changed
    tensor_file.write_bytes(bytes(data))
    assert model_digest(copy) != model_digest(original)


def test_the_router_refuses_nodes_that_serve_another_model():
    import asyncio

    async def go():
        nodes = NodeClient()
        registry = NodeRegistry(nodes, poll_interval_s=0.1, node_expiry_s=10.0)
        registry.expected_model = "sha256:aaaa"
        same = node_info("d1", "decode", fingerprint=dataclasses.replace(FINGERPRINT, model_id="sha256:aaaa"))
        other = node_info(
            "d2", "decode", fingerprint=dataclasses.replace(FINGERPRINT, model_id="sha256:bbbb")
        )
        nodes.reply_path_ok.update({"d1", "d2"})
        registry.update([same, other], now=1.0)
        names = [n.node_id for n in registry.snapshot()]
        await nodes.close()
        return names

    assert asyncio.run(go()) == ["d1"]


def test_a_node_whose_fingerprint_pairs_with_none_is_logged_naming_the_field(caplog):
    import asyncio

    async def go():
        nodes = NodeClient()
        registry = NodeRegistry(nodes, poll_interval_s=0.1, node_expiry_s=10.0)
        decode = node_info("d1", "decode")
        prefill = node_info("p1", "prefill", fingerprint=dataclasses.replace(FINGERPRINT, block_size=32))
        twin = node_info("p2", "prefill")
        with caplog.at_level("ERROR", logger="pdserve.router.registry_client"):
            registry.update([decode], now=1.0)
            registry.update([decode, prefill, twin], now=2.0)
            registry.update([decode, prefill, twin], now=3.0)  # once per node, not per poll
        await nodes.close()

    asyncio.run(go())
    lines = [r.getMessage() for r in caplog.records if "pairs with no" in r.getMessage()]
    assert len(lines) == 1 and "p1" in lines[0] and "block_size (32, d1 has 4)" in lines[0]
