"""Settings written once: a config dataclass's fields declare their own command-line flags.

    @dataclasses.dataclass(frozen=True)
    class EngineConfig:
        block_size: int = setting(16, "tokens per KV block")
        num_threads: int | None = setting(None, "torch threads", flag="--threads")

``flags(EngineConfig)`` lists the flags those fields make; each one adds itself to an argparse
parser or group (``Flag.add_to``), and ``from_args`` builds the dataclass back from the parsed
flags. The same list tells the container entrypoint (launcher/env_flags.py) which PDSERVE_*
variables a command takes, without asking argparse.

A flag is ``--`` and the field's name with ``-`` for ``_``, unless ``flag=`` names it. Its value
type comes from the field's annotation: int, float or str; ``X | None`` (None: not given);
``tuple[X, ...]`` (one value or more); bool, a switch that flips the default (``--x`` sets a False
field, ``--no-x`` clears a True one). It parses as ``args.<flag name in snake case>``, argparse's
own rule, and a switch as ``args.<field>``, unless ``dest=`` says otherwise. A field without a
default is a required flag, and a field declared without ``setting`` has no flag. Here, not in
engine/ or router/, because the router, the nodes and the launcher share it, and it needs neither
torch nor the CLI.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

_KEY = "pdserve.setting"  # the field metadata key a setting rides under


@dataclasses.dataclass(frozen=True, slots=True)
class _Declared:
    help: str
    flag: str | None  # the flag's name when it is not the field's
    dest: str | None  # the parsed attribute when it is not the flag's
    choices: tuple[Any, ...] | None
    metavar: str | None


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    dest: str | None = None,
    choices: Sequence[Any] | None = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is also a command-line flag; no ``default``: a required one."""
    declared = _Declared(help, flag, dest, None if choices is None else tuple(choices), metavar)
    return dataclasses.field(default=default, metadata={_KEY: declared})


class ArgumentTarget(Protocol):  # an argparse parser, argument group or mutually exclusive group
    def add_argument(self, *names: str, **options: Any) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag, as argparse gets it."""

    name: str  # "--kv-cache-memory-mb"
    dest: str  # the parsed attribute: the name in snake case, or the field of a bool switch
    nargs: int | str | None  # values it takes: 0 (a switch), "+" (one or more), None (one)
    value_type: type | None  # each value's type; None for a switch
    default: Any  # a switch stores the opposite of this when given
    help: str
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    required: bool = False

    def add_to(self, target: ArgumentTarget) -> None:
        if self.nargs == 0:
            action = "store_false" if self.default else "store_true"
            target.add_argument(self.name, dest=self.dest, action=action, help=self.help)
            return
        target.add_argument(
            self.name,
            dest=self.dest,
            type=self.value_type,
            nargs=self.nargs,
            default=self.default,
            choices=self.choices,
            metavar=self.metavar,
            required=self.required,
            help=self.help,
        )


def flags(cls: type, *, only: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> tuple[Flag, ...]:
    """The flags ``cls``'s settings make, in field order (``only``/``exclude``: by field name)."""
    return tuple(
        flag
        for field, flag in _declared_flags(cls)
        if (only is None or field.name in only) and field.name not in exclude
    )


def from_args(cls: type, args: Any, **overrides: Any) -> Any:
    """``cls`` built from parsed flags: each setting from its flag, then ``overrides`` on top
    (the fields that are no flag, or values worked out from several flags)."""
    values = {}
    for field, flag in _declared_flags(cls):
        value = getattr(args, flag.dest)
        values[field.name] = tuple(value) if flag.nargs == "+" else value
    return cls(**(values | overrides))


def _declared_flags(cls: type) -> list[tuple[dataclasses.Field, Flag]]:
    hints = typing.get_type_hints(cls)
    return [(f, _flag(f, hints[f.name])) for f in dataclasses.fields(cls) if _KEY in f.metadata]


def _flag(field: dataclasses.Field, hint: Any) -> Flag:
    declared: _Declared = field.metadata[_KEY]
    required = field.default is dataclasses.MISSING
    default = None if required else field.default
    value_type, nargs = _value_type(field.name, hint)
    if value_type is bool:
        assert not required, f"{field.name}: a switch needs a default"
        name = declared.flag or ("--no-" if default else "--") + field.name.replace("_", "-")
        return Flag(name, declared.dest or field.name, 0, None, default, declared.help)
    name = declared.flag or "--" + field.name.replace("_", "-")
    return Flag(
        name,
        dest=declared.dest or name.removeprefix("--").replace("-", "_"),
        nargs=nargs,
        value_type=value_type,
        default=default,
        help=declared.help,
        choices=declared.choices,
        metavar=declared.metavar,
        required=required,
    )


def _value_type(name: str, hint: Any) -> tuple[type, str | None]:
    """A field's value type, and "+" when the flag takes one value or more."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    nargs = None
    if origin in (types.UnionType, typing.Union) and type(None) in args and len(args) == 2:
        (hint,) = (a for a in args if a is not type(None))
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        hint, nargs = args[0], "+"
    if hint not in (int, float, str, bool):
        raise TypeError(f"setting {name}: no flag type for {hint!r}")
    return hint, nargs


# The secret files every cluster process takes, declared once for the nodes and the router.
def redis_password_file_setting() -> Any:
    return setting(
        None, "file holding the Redis password (a mounted secret), instead of one in the URL", metavar="PATH"
    )


def cluster_key_file_setting() -> Any:
    return setting(
        None,
        "file with the cluster's shared key (64 hex digits): registry records are signed with it and "
        "every socket runs CURVE under it; required when binding beyond loopback",
        metavar="PATH",
    )


def otlp_traces_endpoint_setting() -> Any:
    return setting(
        None,
        "export OpenTelemetry traces to this OTLP endpoint, as vLLM's flag (port 4317: gRPC, else "
        "HTTP/protobuf; OTEL_EXPORTER_OTLP_* variables turn traces on too: docs/operations.md, Traces)",
        metavar="URL",
    )
