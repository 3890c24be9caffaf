"""The engine's seam, as docs/design.md states it: its API, its imports, and who holds a request.

The holder test runs a real prefill node and a real decode node (engines, runtimes, the shipper
and the KV receiver over loopback sockets) in this process, drives their loops by hand, and looks
into their objects at each stage of one request's life: its id must appear in exactly the three
holders the design names on each node, and nowhere once it is over.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import queue
import re
import time

import pytest
import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.node.host import NodeHost
from pdserve.node.options import NodeOptions
from pdserve.protocol.messages import GenerateRequest, TokenChunk, decode_frames
from pdserve.protocol.sampling_params import SamplingParams
from tests.engine_helpers import hf_greedy
from tests.tiny_models import make_tiny_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "docs" / "design.md").read_text()

ENGINE_API = (
    "add_request",
    "step",
    "abort_request",
    "stats",
    "has_work",
    "note_idle",
    "warm_up",
    "load_adapter",
    "unload_adapter",
    "close",
)
# each node's holders of a request's state: the role's attributes (the engine counts once)
PREFILL_HOLDERS = {"engine", "shipper", "pending"}
DECODE_HOLDERS = {"engine", "receiver", "streams"}


def test_the_engine_api_is_add_step_abort_stats_and_its_admin_calls():
    public = [
        name
        for name, value in vars(LLMEngine).items()
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    ]
    assert sorted(public) == sorted(ENGINE_API) and len(public) <= 10
    assert all(f"`{name}`" in DESIGN for name in ENGINE_API)  # docs/design.md lists them


def test_the_engine_imports_nothing_from_kv_transfer():
    offenders = []
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("pdserve.kv_transfer")]
    assert offenders == []


def test_beam_search_and_lora_admission_are_one_call_each_in_the_loop():
    """LLMEngine.step and Scheduler.schedule consult the features through one call each."""
    sources = {
        "step": _function_source(ROOT / "engine" / "llm_engine.py", "LLMEngine", "_run"),
        "schedule": _function_source(
            ROOT / "engine" / "core" / "scheduler.py", "Scheduler", "_schedule_waiting"
        ),
    }
    assert len(re.findall(r"self\.beams\.\w+\(", sources["step"])) == 1
    assert "lora" not in sources["step"] and "adapter" not in sources["step"]
    assert len(re.findall(r"self\._admit\(", sources["schedule"])) == 1
    assert len(re.findall(r"self\._gang_fits\(", sources["schedule"])) == 1
    assert "beam" not in _function_source(ROOT / "engine" / "llm_engine.py", "LLMEngine", "step")


def _function_source(path: pathlib.Path, cls: str, name: str) -> str:
    tree = ast.parse(path.read_text())
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    (fn,) = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return ast.get_source_segment(path.read_text(), fn) or ""


def test_design_md_states_the_holder_counts_the_test_checks():
    table = DESIGN[DESIGN.index("## Who holds what") :]
    for process, holders in (("prefill", PREFILL_HOLDERS), ("decode", DECODE_HOLDERS)):
        rows = [line for line in table.splitlines() if line.startswith(f"| {process} |")]
        assert len(rows) == len(holders) == 3, process
    assert "Three holders of a request's state per node" in table


# ---------------------------------------------------------------------- a request's holders
def _holders(role, request_id: str) -> set[str]:
    """The role's attributes under which ``request_id`` is held: as a key of a dict, or as the
    ``request_id`` of an object, anywhere in the objects reachable from that attribute."""
    found = set()
    for name, value in vars(role).items():
        if name in ("opts", "fingerprint"):  # configuration
            continue
        if _holds(value, request_id, set(), 0):
            found.add(name)
    return found


def _holds(obj, request_id: str, seen: set[int], depth: int) -> bool:
    if depth > 8 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return False
    seen.add(id(obj))
    if isinstance(obj, dict):
        if request_id in obj:
            return True
        return any(_holds(v, request_id, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return any(_holds(v, request_id, seen, depth + 1) for v in obj)
    if isinstance(obj, queue.SimpleQueue | queue.Queue):
        return False  # outcomes on their way to the loop: messages, not state
    module = type(obj).__module__
    if not module.startswith("pdserve"):
        return False
    if getattr(obj, "request_id", None) == request_id:
        return True
    fields = getattr(obj, "__dict__", None) or {
        slot: getattr(obj, slot) for slot in _slots(type(obj)) if hasattr(obj, slot)
    }
    return any(_holds(v, request_id, seen, depth + 1) for v in fields.values())


def _slots(cls) -> list[str]:
    return [s for klass in cls.__mro__ for s in getattr(klass, "__slots__", ())]


def _host(role: str, path: str) -> NodeHost:
    opts = NodeOptions(
        role=role,
        host="127.0.0.1",
        advertise_host="127.0.0.1",
        heartbeat_interval_s=0.05,
        heartbeat_ttl_s=1.0,
        request_ttl_s=60.0,
        model_id="tiny",
    )
    host = NodeHost(opts, EngineConfig(model=path, num_kv_blocks=32, block_size=8))
    host.parts.runtime.start(host.role.status(), None)
    return host


@pytest.fixture(scope="module")
def pair():
    path = str(make_tiny_model("llama"))
    prefill, decode = _host("prefill", path), _host("decode", path)
    yield path, prefill, decode
    for host in (prefill, decode):
        host.role.close("test over")
        host.parts.runtime.close()
        host.parts.engine.close()


def _turn(*hosts: NodeHost) -> None:
    for host in hosts:
        for msg in host.parts.runtime.poll_control(0.0):
            host.role.on_control(msg)
        host.role.work()


def test_a_request_has_three_holders_on_each_node_and_none_once_it_is_over(pair):
    path, prefill, decode = pair
    reply = zmq.Context.instance().socket(zmq.PULL)  # where a router's replies would go
    reply_addr = f"tcp://127.0.0.1:{reply.bind_to_random_port('tcp://127.0.0.1')}"
    prompt, rid = list(range(3, 30)), "held-1"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prefill.role.on_control(
        GenerateRequest(
            request_id=rid,
            token_ids=tuple(prompt),
            sampling_params=params,
            reply_addr=reply_addr,
            decode_addr=decode.role.kv_addr,
            deadline=time.time() + 60,
        )
    )
    seen: dict[str, list[set[str]]] = {"prefill": [], "decode": []}
    seen["prefill"].append(_holders(prefill.role, rid))  # queued: the engine and the stream
    for _ in range(200):  # the prefill node alone: its first token, then the shipper waits for a grant
        _turn(prefill)
        if prefill.role.pending.get(rid) is not None and prefill.role.pending[rid].shipping:
            break
    seen["prefill"].append(_holders(prefill.role, rid))  # held for the shipper
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        _turn(prefill, decode)
        for holders, role in ((seen["prefill"], prefill.role), (seen["decode"], decode.role)):
            if (now := _holders(role, rid)) and now not in holders:
                holders.append(now)
        if not reply.poll(10):
            continue
        header, *frames = reply.recv_multipart(copy=False)
        msg = decode_frames(header.buffer, [f.buffer for f in frames], 1 << 20)
        assert isinstance(msg, TokenChunk), msg
        tokens += msg.token_ids
        if msg.finish_reason is not None:
            break
    reply.close()
    for _ in range(20):  # the shipper's outcome: the prefill node's last holder lets go
        _turn(prefill, decode)
    assert tokens == hf_greedy(path, prompt, 6)
    assert set().union(*seen["prefill"]) == PREFILL_HOLDERS, seen["prefill"]
    assert set().union(*seen["decode"]) == DECODE_HOLDERS, seen["decode"]
    assert _holders(prefill.role, rid) == set() and _holders(decode.role, rid) == set()
    for host in (prefill, decode):
        stats = host.parts.engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_held == 0
