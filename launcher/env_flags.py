"""Container entrypoint: PDSERVE_* environment variables become the flags of a pdserve command.

    PDSERVE_<NAME>=value   ->  --<name> value     (upper case and '_' in the variable, '-' in the flag)
    e.g. PDSERVE_KV_CACHE_MEMORY_MB=2048 -> --kv-cache-memory-mb 2048,  PDSERVE_REDIS=URL -> --redis URL

A flag without a value (--no-prefix-caching) is set by 1/true/yes and left off by 0/false/no; an
empty variable counts as unset; a list flag (--decode A B) takes a space-separated value. A
PDSERVE_ variable that names no flag of the command is an error, so a typo stops the container
instead of being ignored. Usage: python -m launcher.env_flags COMMAND [more flags]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

PREFIX = "PDSERVE_"
# Read from the environment by the code itself, not command-line flags: the model cache directory
# (engine.model_fetch), the switch of the CPU attention kernel (kernels.cpu_ext) and the tests'
# GPU stand-in (engine.platform).
NOT_FLAGS = frozenset({"PDSERVE_CACHE", "PDSERVE_NATIVE_CPU", "PDSERVE_TEST_PLATFORM"})
TRUE, FALSE = frozenset({"1", "true", "yes"}), frozenset({"0", "false", "no"})


def command_parser(command: str) -> argparse.ArgumentParser:
    from pdserve_cli.main import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    if command not in subparsers.choices:
        raise ValueError(f"unknown pdserve command {command!r}")
    return subparsers.choices[command]


def flag_for(variable: str) -> str:
    return "--" + variable.removeprefix(PREFIX).lower().replace("_", "-")


def flags_from_env(command: str, env: Mapping[str, str]) -> list[str]:
    """The flags the PDSERVE_* variables in ``env`` stand for; ValueError for one that maps to none."""
    options = {opt: action for action in command_parser(command)._actions for opt in action.option_strings}
    argv: list[str] = []
    for name in sorted(env):
        if not name.startswith(PREFIX) or name in NOT_FLAGS:
            continue
        value, flag = env[name].strip(), flag_for(name)
        action = options.get(flag)
        if action is None:
            raise ValueError(f"{name}: `pdserve {command}` has no flag {flag}")
        if value == "":
            continue
        if action.nargs == 0:
            if value.lower() not in TRUE | FALSE:
                raise ValueError(f"{name}={value!r}: {flag} takes no value; use 1 or 0")
            argv += [flag] if value.lower() in TRUE else []
        elif action.nargs in ("+", "*"):
            argv += [flag, *value.split()]
        else:
            argv += [flag, value]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve_cli.main import main as pdserve

    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m launcher.env_flags COMMAND [flags]")
    try:
        flags = flags_from_env(args[0], os.environ)
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    return pdserve([args[0], *flags, *args[1:]])


if __name__ == "__main__":
    sys.exit(main())
