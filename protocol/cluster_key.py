"""The cluster key: one shared secret per cluster, held by its router and nodes, never in an image.

It lives in a file (``--cluster-key-file``; compose and Kubernetes mount it from a secret, and
``pdserve up`` writes a fresh one per cluster): 64 hex digits, or any 32 bytes or more. What is
signed under it, so that a writer without it is refused:

    registry record  mac = HMAC-SHA256(key, "pdserve-record-v1" ‖ redis key ‖ every field, sorted)

The MAC covers the Redis key, so a valid record cannot be copied under another node's name, and
every field, so none can be changed (a node's addresses above all: where prompts would go).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import secrets

KEY_BYTES = 32
MAC_FIELD = "mac"  # the registry record's field that carries it
_RECORD_CONTEXT = b"pdserve-record-v1"


class ClusterKeyError(ValueError):
    """A key file that is missing, unreadable or too short."""


def load_key(path: str | os.PathLike) -> bytes:
    try:
        raw = pathlib.Path(path).read_bytes().strip()
    except OSError as exc:
        raise ClusterKeyError(f"cluster key file {path}: {exc.strerror or exc}") from None
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = raw  # not hex: the bytes themselves
    if len(key) < KEY_BYTES:
        raise ClusterKeyError(
            f"cluster key file {path}: {len(key)} bytes of key, at least {KEY_BYTES} needed "
            f"(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > {path}`)"
        )
    return key


def write_new_key(path: str | os.PathLike) -> bytes:
    """A fresh random key in ``path`` (created readable by its owner only); returns it."""
    key = secrets.token_bytes(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def record_mac(key: bytes, redis_key: str, fields: dict[str, str]) -> str:
    """The MAC of a registry record's fields (its own ``mac`` field left out)."""
    body = json.dumps(
        [redis_key, sorted((k, v) for k, v in fields.items() if k != MAC_FIELD)], separators=(",", ":")
    )
    return hmac.new(key, _RECORD_CONTEXT + body.encode(), hashlib.sha256).hexdigest()


def record_problem(key: bytes, redis_key: str, fields: dict[str, str]) -> str | None:
    """Why a record is not signed under ``key`` (None: it is)."""
    mac = fields.get(MAC_FIELD)
    if not mac:
        return "unsigned"
    if not hmac.compare_digest(mac, record_mac(key, redis_key, fields)):
        return "bad MAC (another key, or a changed field)"
    return None
