"""Container entrypoint: PDSERVE_* environment variables become the flags of a pdserve command.

    PDSERVE_<NAME>=value   ->  --<name> value     (upper case and '_' in the variable, '-' in the flag)
    e.g. PDSERVE_KV_CACHE_MEMORY_MB=2048 -> --kv-cache-memory-mb 2048,  PDSERVE_REDIS=URL -> --redis URL

A flag without a value (--no-prefix-caching) is set by 1/true/yes and left off by 0/false/no; an
empty variable counts as unset; a list flag (--decode A B) takes a space-separated value. A
PDSERVE_ variable that names no flag of the command is an error, so a typo stops the container
instead of being ignored. The commands that take them are the container's services, router,
prefill and decode, whose flags their config dataclasses declare (protocol/settings.py); any other
command runs as given, and reads the PDSERVE_ variables it knows itself (``status`` its
PDSERVE_REDIS). Usage: python -m pdserve.launcher.env_flags COMMAND [more flags]
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

from pdserve.node.options import node_flags
from pdserve.protocol.settings import Flag, flags
from pdserve.router.config import RouterConfig

PREFIX = "PDSERVE_"
# Read from the environment by the code itself, not command-line flags: the model cache directory
# (engine.model_fetch), the switch of the CPU attention kernel (kernels.cpu_ext), the span ports
# are chosen from (launcher.ports) and the tests' GPU stand-in (engine.platform).
NOT_FLAGS = frozenset({"PDSERVE_CACHE", "PDSERVE_NATIVE_CPU", "PDSERVE_PORT_RANGE", "PDSERVE_TEST_PLATFORM"})
TRUE, FALSE = frozenset({"1", "true", "yes"}), frozenset({"0", "false", "no"})


SERVICES = ("router", "prefill", "decode")  # the commands whose flags PDSERVE_ variables set


def command_flags(command: str) -> dict[str, Flag]:
    """`pdserve COMMAND`'s flags by name, as the settings that make them declare them."""
    if command == "router":
        declared = flags(RouterConfig)
    elif command in ("prefill", "decode"):
        declared = tuple(flag for section in node_flags(command).values() for flag in section)
    else:
        raise ValueError(
            f"only {', '.join(SERVICES)} take flags from PDSERVE_ variables, not `pdserve {command}`"
        )
    return {flag.name: flag for flag in declared}


def flag_for(variable: str) -> str:
    return "--" + variable.removeprefix(PREFIX).lower().replace("_", "-")


def flags_from_env(command: str, env: Mapping[str, str]) -> list[str]:
    """The flags the PDSERVE_* variables in ``env`` stand for; ValueError for one that maps to none."""
    names = sorted(name for name in env if name.startswith(PREFIX) and name not in NOT_FLAGS)
    if not names or command not in SERVICES:  # another command reads its own variables
        return []
    options = command_flags(command)
    argv: list[str] = []
    for name in names:
        value, flag = env[name].strip(), flag_for(name)
        option = options.get(flag)
        if option is None:
            raise ValueError(f"{name}: `pdserve {command}` has no flag {flag}")
        if value == "":
            continue
        if option.nargs == 0:
            if value.lower() not in TRUE | FALSE:
                raise ValueError(f"{name}={value!r}: {flag} takes no value; use 1 or 0")
            argv += [flag] if value.lower() in TRUE else []
        elif option.nargs == "+":
            argv += [flag, *value.split()]
        else:
            argv += [flag, value]
    return argv


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m pdserve.launcher.env_flags COMMAND [flags]")
    try:
        flags = flags_from_env(args[0], os.environ)
    except ValueError as exc:
        raise SystemExit(f"pdserve: {exc}") from None
    # Exec rather than import the CLI: this process (a container's PID 1, which SIGTERM reaches)
    # becomes `pdserve`, and the launcher depends on no command module.
    command = [sys.executable, "-m", "pdserve", args[0], *flags, *args[1:]]
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
