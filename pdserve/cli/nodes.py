"""`pdserve prefill` and `pdserve decode [--colocated]`: start a node process."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    for role, help_text in (
        ("prefill", "run a prefill node (prompt KV → decode nodes)"),
        ("decode", "run a decode node (continuous-batching decode)"),
    ):
        parser = subparsers.add_parser(role, help=help_text, description=help_text)
        from pdserve.node.options import add_node_args

        add_node_args(parser, role)  # decode adds --colocated
        parser.set_defaults(run=_runner(role))


def _runner(role: str):
    def run(args: argparse.Namespace) -> int:
        from pdserve.node.options import options_from_args
        from pdserve.protocol.registry import Role

        colocated = getattr(args, "colocated", False)
        opts, engine_config = options_from_args(Role.COLOCATED if colocated else Role(role), args)
        from pdserve.node.host import NodeHost

        return NodeHost(opts, engine_config).serve(opts.ready_file)

    return run
