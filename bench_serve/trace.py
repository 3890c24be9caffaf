"""The workload file: one JSON object per line, to replay a recorded trace or keep a generated one.

    {"prompt": "text", "output_len": 64, "arrival_s": 0.0}
    {"prompt": [101, 2023, 318], "output_len": 16, "arrival_s": 0.35}
    {"prompt": [{"role": "user", "content": "hi"}], "output_len": 32, "conversation": 4, "turn": 1}

``prompt`` is text or token ids (completions) or a list of messages (chat). ``arrival_s`` (seconds
after the start, non-decreasing) is optional: without it the arrival process decides, as for
generated workloads. ``conversation`` and ``turn`` are optional too (multi-turn ordering).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable
from typing import Any

from pdserve.bench_serve.workload import ChatMessage, Prompt, WorkItem


def item_to_json(item: WorkItem) -> dict[str, Any]:
    record: dict[str, Any] = {"prompt": _prompt_to_json(item.prompt), "output_len": item.output_len}
    if item.arrival_s is not None:
        record["arrival_s"] = item.arrival_s
    if item.conversation is not None:
        record |= {"conversation": item.conversation, "turn": item.turn}
    return record


def item_from_json(record: dict[str, Any], where: str = "item") -> WorkItem:
    unknown = set(record) - {"prompt", "output_len", "arrival_s", "conversation", "turn"}
    if unknown:
        raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
    if "prompt" not in record or "output_len" not in record:
        raise ValueError(f"{where}: needs 'prompt' and 'output_len'")
    output_len = record["output_len"]
    if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
        raise ValueError(f"{where}: output_len must be a positive integer, got {output_len!r}")
    arrival = record.get("arrival_s")
    if arrival is not None and (not isinstance(arrival, int | float) or arrival < 0):
        raise ValueError(f"{where}: arrival_s must be a number >= 0, got {arrival!r}")
    return WorkItem(
        _prompt_from_json(record["prompt"], where),
        output_len,
        None if arrival is None else float(arrival),
        record.get("conversation"),
        record.get("turn", 0),
    )


def _prompt_to_json(prompt: Prompt) -> str | list:
    if isinstance(prompt, str):
        return prompt
    return [{"role": p.role, "content": p.content} if isinstance(p, ChatMessage) else p for p in prompt]


def _prompt_from_json(raw: Any, where: str) -> Prompt:
    if isinstance(raw, str) and raw:
        return raw
    if isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        return tuple(raw)
    if (
        isinstance(raw, list)
        and raw
        and all(isinstance(m, dict) and set(m) == {"role", "content"} for m in raw)
    ):
        return tuple(ChatMessage(str(m["role"]), str(m["content"])) for m in raw)
    raise ValueError(f"{where}: prompt must be non-empty text, token ids, or messages with role and content")


def write(path: pathlib.Path, items: Iterable[WorkItem]) -> None:
    with path.open("w") as f:
        for item in items:
            f.write(json.dumps(item_to_json(item), ensure_ascii=False) + "\n")


def read(path: pathlib.Path) -> list[WorkItem]:
    items = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: each line must be a JSON object")
        items.append(item_from_json(record, where))
    _check_arrivals(items, str(path))
    return items


def _check_arrivals(items: list[WorkItem], where: str) -> None:
    times = [item.arrival_s for item in items]
    if any(t is None for t in times) and any(t is not None for t in times):
        raise ValueError(f"{where}: give arrival_s on every line or on none")
    if any(a is not None and b is not None and b < a for a, b in zip(times, times[1:], strict=False)):
        raise ValueError(f"{where}: arrival_s must not decrease from line to line")
