"""`pdserve status`: the node pools as the Redis registry sees them, one table per role."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
COLUMNS = (
    "NODE",
    "ADDRESS",
    "KV FREE/TOTAL",
    "CACHED",
    "COMMITTED",
    "QUEUED",
    "RUNNING",
    "MEAN STEP",
    "DRAFTS KEPT",
    "HEARTBEAT",
    "STATE",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status",
        help="show the prefill and decode pools registered in Redis",
        description="List the nodes registered in Redis by role: free and total KV blocks, the share "
        "of the pool committed, queued and "
        "running requests, heartbeat age, and whether each is draining.",
    )
    parser.add_argument(
        "--redis",
        default=os.environ.get("PDSERVE_REDIS", DEFAULT_REDIS),
        metavar="URL",
        help=f"the registry (default: $PDSERVE_REDIS, else {DEFAULT_REDIS})",
    )
    parser.add_argument(
        "--cluster-key-file",
        default=os.environ.get("PDSERVE_CLUSTER_KEY_FILE"),
        metavar="PATH",
        help="the cluster key: list only records signed with it, and say which were refused "
        "(default: $PDSERVE_CLUSTER_KEY_FILE; none: every record, unchecked)",
    )
    parser.add_argument(
        "--redis-password-file",
        default=os.environ.get("PDSERVE_REDIS_PASSWORD_FILE"),
        metavar="PATH",
        help="file with the registry's password (default: $PDSERVE_REDIS_PASSWORD_FILE, else the URL's)",
    )
    parser.set_defaults(run=run_status)


def run_status(args: argparse.Namespace) -> int:
    import redis

    from pdserve.protocol.cluster_key import ClusterKeyError, load_key
    from pdserve.protocol.registry import connect, list_nodes

    try:
        key = load_key(args.cluster_key_file) if args.cluster_key_file else None
        client = connect(args.redis, args.redis_password_file, socket_timeout=2.0, socket_connect_timeout=2.0)
    except (ClusterKeyError, OSError) as exc:
        print(f"pdserve status: {exc}", file=sys.stderr)
        return 1
    refused: list[str] = []
    try:
        nodes = list_nodes(client, key, refused)
    except redis.RedisError as exc:
        print(f"pdserve status: cannot read the registry at {args.redis}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(render(nodes, now=time.time()))
    if refused:
        print(f"\nrefused: {len(refused)} record(s) not signed with the cluster key")
        print("\n".join(f"  {problem}" for problem in refused))
    return 0


def render(nodes: Sequence, now: float) -> str:
    """Nodes grouped by role (prefill, decode, then colocated where there are any), a table each,
    and a line of totals per role."""
    if not nodes:
        return "no nodes registered"
    sections = []
    roles = (
        ("prefill", "decode", "colocated")
        if any(n.role == "colocated" for n in nodes)
        else ("prefill", "decode")
    )
    for role in roles:
        pool = [n for n in nodes if n.role == role]
        serving = sum(not n.draining for n in pool)
        free = sum(n.num_blocks_free for n in pool)
        total = sum(n.num_blocks_total for n in pool)
        title = f"{role}: {len(pool)} node(s), {serving} serving, KV blocks {free}/{total} free"
        int8 = sum(n.fingerprint.dtype == "int8" for n in pool)  # --kv-cache-dtype int8
        title += f" ({int8} with int8 rows)" if int8 else ""
        rows = [_row(n, now) for n in pool]
        sections.append(title + ("\n" + _table(rows) if rows else ""))
    return "\n\n".join(sections)


def _row(node, now: float) -> tuple[str, ...]:
    return (
        node.node_id,
        node.control_addr,
        f"{node.num_blocks_free}/{node.num_blocks_total}",
        str(node.num_blocks_cached),
        _committed(node),
        str(node.num_queued),
        str(node.num_running),
        _mean_steps(node),
        _drafts_kept(node),
        f"{max(0.0, now - node.heartbeat_time):.1f}s ago",
        _state(node),
    )


def _committed(node) -> str:
    """The share of the KV pool whose memory is committed (engine/executor/kv_prefault.py); "-" where the
    node does not say."""
    if node.num_blocks_committed is None or node.num_blocks_total <= 0:
        return "-"
    return f"{node.num_blocks_committed / node.num_blocks_total:.0%}"


def _mean_steps(node) -> str:
    """Mean engine step time by kind since the node started (engine/core/step_stats.py), e.g.
    "decode 36ms, mixed 191ms"; "-" before its first step."""
    parts = []
    for kind in ("decode", "mixed", "prefill"):
        counts = node.step_stats.get(kind) or {}
        steps, seconds = counts.get("steps", 0), counts.get("seconds", 0.0)
        if isinstance(steps, int) and steps > 0 and isinstance(seconds, int | float):
            parts.append(f"{kind} {seconds / steps * 1e3:.0f}ms")
    return ", ".join(parts) or "-"


def _drafts_kept(node) -> str:
    """Speculative decoding's acceptance since the node started, e.g. "62% of 1840"; "-" where it
    is off or nothing was proposed yet."""
    spec = node.speculation or {}
    proposed, accepted = spec.get("proposed_tokens"), spec.get("accepted_tokens")
    if not isinstance(proposed, int) or not isinstance(accepted, int) or proposed <= 0:
        return "-"
    return f"{accepted / proposed:.0%} of {proposed}"


def _state(node) -> str:
    if node.integrity_error:
        return f"failed: {node.integrity_error}"
    return "draining" if node.draining else "serving"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in (COLUMNS, *rows)) for i in range(len(COLUMNS))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in (COLUMNS, *rows)
    )
