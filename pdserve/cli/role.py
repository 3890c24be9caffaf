"""`pdserve role NODE_ID ROLE`: switch a live node to another role through the router, without
reloading its weights (the router's ``POST /admin/nodes/{node_id}/role``; node.host)."""

from __future__ import annotations

import argparse
import json
import os
import sys

ROLES = ("prefill", "decode", "colocated")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    help_text = "switch a live node to another role (prefill, decode, colocated) without a reload"
    parser = subparsers.add_parser("role", help=help_text, description=help_text)
    parser.add_argument("node_id", help="the node's id (`pdserve status` lists them)")
    parser.add_argument("role", choices=ROLES)
    parser.add_argument(
        "--router", default="http://127.0.0.1:8000", help="the router's URL (default: %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="the router's --api-key, if it has one (default: $PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the node's drain (default: 60)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{args.router.rstrip('/')}/admin/nodes/{args.node_id}/role"
    try:
        reply = httpx.post(
            url,
            json={"role": args.role, "timeout_s": args.timeout},
            headers=headers,
            timeout=args.timeout + 10,
        )
    except httpx.HTTPError as exc:
        print(f"pdserve role: cannot reach the router at {args.router}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        print(f"pdserve role: {reply.status_code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply.json()))
    return 0
