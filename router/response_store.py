"""The router's store of Responses API responses: what ``GET /v1/responses/{id}`` returns and
what ``previous_response_id`` continues.

Bounded two ways (``--responses-store-size`` entries, least recently used out first, and
``--responses-store-ttl-s`` seconds after an entry was last stored or used) and held in this
router's memory only: a restart forgets it, and behind several routers a conversation must come
back to the router that stored its previous turn (docs/api.md).

Each entry keeps its own turn only (the chat messages its input made, without instructions, and
the messages its output made) and the id of the turn before, so a conversation of N turns holds
each turn once; ``history`` walks the chain back. A conversation whose earlier turn has left the
store cannot be continued (a 404 naming ``previous_response_id``), never continued with a gap.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from pdserve.router.errors import APIError


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET returns it
    input_messages: tuple[dict[str, Any], ...]  # this turn's input as chat messages (no system)
    output_messages: tuple[dict[str, Any], ...]  # this turn's output as chat messages
    previous_id: str | None  # the turn it continued


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries  # 0: nothing is stored
        self._ttl_s = ttl_s
        self._entries: collections.OrderedDict[str, tuple[float, StoredResponse]] = collections.OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        self._entries[response_id] = (time.monotonic() + self._ttl_s, entry)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None when unknown or expired; a hit counts as a use (LRU, TTL)."""
        held = self._entries.get(response_id)
        if held is None:
            return None
        if held[0] < time.monotonic():
            del self._entries[response_id]
            return None
        self._entries[response_id] = (time.monotonic() + self._ttl_s, held[1])
        self._entries.move_to_end(response_id)
        return held[1]

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._entries.pop(response_id, None) is not None

    def history(self, previous_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including ``previous_id``'s turn,
        oldest first; a 404 naming previous_response_id when any turn of it is gone."""
        turns: list[StoredResponse] = []
        next_id: str | None = previous_id
        while next_id is not None:
            entry = self.get(next_id)
            if entry is None:
                raise not_found(previous_id, "previous_response_id", next_id)
            turns.append(entry)
            next_id = entry.previous_id
            if len(turns) > self.max_entries:  # a cycle cannot be built, but never loop
                break
        return [m for turn in reversed(turns) for m in (*turn.input_messages, *turn.output_messages)]


def not_found(response_id: str, param: str | None, missing: str | None = None) -> APIError:
    """OpenAI's 404 for a response id; ``missing``: the earlier turn that left the store."""
    message = f"Response with id '{response_id}' not found."
    if missing is not None and missing != response_id:
        message = (
            f"Response with id '{response_id}' cannot be continued: its earlier turn '{missing}' has "
            "left the router's response store (--responses-store-size, --responses-store-ttl-s)."
        )
    return APIError(404, message, param, "response_not_found")
