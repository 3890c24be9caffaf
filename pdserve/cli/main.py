"""The `pdserve` command: one argparse parser assembled from per-command modules.

Each command module exposes `add_parser(subparsers)`, which registers its parser and binds its
handler with `set_defaults(run=...)`; a handler takes the parsed args and returns an exit code.
Adding a command (prefill, decode, router, up, status, bench, ...) is one module and one line below.
Command modules import heavy dependencies (torch, transformers) inside their handlers only, so
`pdserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import sys
from collections.abc import Sequence

from pdserve.engine.machine.cpu_env import apply_openmp_defaults

apply_openmp_defaults()  # the process entry point: before any handler loads torch (engine/machine/cpu_env.py)

from pdserve.cli import bench, generate, model, nodes, plan, role, router_cmd, status, up  # noqa: E402

COMMAND_MODULES = (model, generate, nodes, router_cmd, up, status, role, bench, plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="LLM serving with disaggregated prefill and decode over a paged KV cache.",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    for module in COMMAND_MODULES:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):  # no real stderr
        faulthandler.enable(sys.__stderr__)  # a crash (SIGSEGV, SIGBUS, ...) leaves a traceback in the log
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
