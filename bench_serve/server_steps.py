"""What a pdserve server's engines did during a run: steps, seconds and tokens by node role and
step kind, the difference of the router's ``pdserve_node_engine_*`` counters across the run.

They say which part of a latency figure is engine time: a TPOT of 110 ms made of decode steps of
35 ms and mixed steps of 250 ms points at prefill chunks sharing the batch, not at the serving
path. Other servers (vLLM) have no such counters; the bench then reports nothing for them.
"""

from __future__ import annotations

import dataclasses
import re
import time

import httpx

# Labels in any order: prometheus-client writes them sorted (kind, node_id, phase, role).
_SERIES = re.compile(
    r"^pdserve_node_engine_(step_seconds_sum|step_seconds_count|tokens_total)\{([^}]*)\} (\S+)$", re.M
)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
Counts = dict[tuple[str, str, str, str], float]  # (node_id, role, kind, what) -> the node's count


@dataclasses.dataclass(frozen=True, slots=True)
class StepLine:
    role: str  # the nodes' role: prefill, decode or colocated
    kind: str  # prefill, decode or mixed rows (engine/core/step_stats.py)
    steps: int  # engine steps of this kind during the run, over the role's nodes
    seconds: float  # their wall time
    prompt_tokens: int  # prompt tokens they computed
    decode_tokens: int  # decode rows they computed

    @property
    def mean_ms(self) -> float:
        return self.seconds / self.steps * 1e3


_WHAT = ("step_seconds_count", "step_seconds_sum", "prompt_tokens", "decode_tokens")


def parse(text: str) -> Counts:
    counts: Counts = {}
    for what, labels, value in _SERIES.findall(text):
        label = dict(_LABEL.findall(labels))
        what = f"{label['phase']}_tokens" if "phase" in label else what
        counts[label["node_id"], label["role"], label["kind"], what] = float(value)
    return counts


def scrape(base_url: str, api_key: str | None = None, timeout_s: float = 5.0) -> Counts | None:
    """The server's engine counters, or None where it has none (not pdserve, or no /metrics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        reply = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200 or "pdserve_node_engine_step_seconds" not in reply.text:
        return None
    return parse(reply.text)


def settled(
    base_url: str, api_key: str | None = None, wait_s: float = 1.0, max_s: float = 6.0
) -> Counts | None:
    """Scrapes until two reads ``wait_s`` apart agree: the nodes' counters reach the router with
    their heartbeats, a second or so after the steps ran. Gives up after ``max_s``."""
    now = scrape(base_url, api_key)
    deadline = time.monotonic() + max_s
    while now is not None and time.monotonic() < deadline:
        time.sleep(wait_s)
        later = scrape(base_url, api_key)
        if later == now:
            break
        now = later
    return now


def difference(before: Counts, after: Counts) -> list[StepLine]:
    """Each role's steps by kind between two scrapes, summed over its nodes. A node whose step
    count went down restarted in between: its counts since the restart are its part."""
    totals: dict[tuple[str, str], list[float]] = {}
    for node, role, kind in sorted({key[:3] for key in after}):
        then = {w: before.get((node, role, kind, w), 0.0) for w in _WHAT}
        now = {w: after.get((node, role, kind, w), 0.0) for w in _WHAT}
        if now["step_seconds_count"] < then["step_seconds_count"]:
            then = dict.fromkeys(_WHAT, 0.0)
        sums = totals.setdefault((role, kind), [0.0] * len(_WHAT))
        for i, w in enumerate(_WHAT):
            sums[i] += now[w] - then[w]
    return [
        StepLine(role, kind, int(steps), seconds, int(prompt), int(decode))
        for (role, kind), (steps, seconds, prompt, decode) in sorted(totals.items())
        if steps > 0
    ]


def describe(lines: list[StepLine]) -> list[str]:
    return [
        f"engine steps  {s.role} {s.kind}: {s.steps} x {s.mean_ms:.1f} ms ({s.seconds:.1f} s; "
        f"{s.prompt_tokens} prompt, {s.decode_tokens} decode tokens)"
        for s in lines
    ]
