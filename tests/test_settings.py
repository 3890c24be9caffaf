"""Settings written once: config fields declare their flags, and the container's PDSERVE_* variables
map onto the same declarations (protocol/settings.py, launcher/env_flags.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import subprocess
import sys

import pytest

from pdserve.cli.main import build_parser
from pdserve.engine.config import EngineConfig
from pdserve.launcher.env_flags import NOT_FLAGS, command_flags, flags_from_env
from pdserve.protocol.settings import Flag, flags, from_args, setting

ROOT = pathlib.Path(__file__).resolve().parent.parent

NO_FLAG = {"enable_chunked_prefill"}  # the EngineConfig fields a node never changes from the command line
# A value other than the default for each engine flag that is not a switch and has no choices.
OTHER_VALUES = {
    "--device": "cpu",
    "--kv-cache-memory-fraction": "0.5",
    "--gpu-memory-utilization": "0.5",
    "--lora-modules": "extra=/adapters/extra",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Toy:
    path: str = setting(help="required: no default")
    size: int = setting(4, "an int")
    share: float | None = setting(None, "None when not given", flag="--share-of-it")
    mode: str = setting("a", "one of two", choices=("a", "b"))
    addrs: tuple[str, ...] = setting((), "one or more", metavar="ADDR")
    verbose: bool = setting(False, "a switch that turns it on")
    cache: bool = setting(True, "a switch that turns it off")
    url: str | None = setting(None, "parsed under the field's name", flag="--url-flag", dest="url")
    internal: int = 7  # no setting: no flag


def toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for flag in flags(Toy):
        flag.add_to(parser)
    return parser


def test_fields_make_flags_named_and_typed_by_their_declaration():
    assert [(f.name, f.dest, f.nargs, f.value_type, f.default, f.required) for f in flags(Toy)] == [
        ("--path", "path", None, str, None, True),
        ("--size", "size", None, int, 4, False),
        ("--share-of-it", "share_of_it", None, float, None, False),
        ("--mode", "mode", None, str, "a", False),
        ("--addrs", "addrs", "+", str, (), False),
        ("--verbose", "verbose", 0, None, False, False),
        ("--no-cache", "cache", 0, None, True, False),
        ("--url-flag", "url", None, str, None, False),
    ]
    assert [f.name for f in flags(Toy, only=("size", "cache"))] == ["--size", "--no-cache"]
    assert [f.name for f in flags(Toy, exclude=("path", "addrs", "url"))][:2] == ["--size", "--share-of-it"]


def test_from_args_builds_the_dataclass_from_its_parsed_flags():
    args = toy_parser().parse_args(
        ["--path", "p", "--size", "5", "--share-of-it", "0.5", "--mode", "b", "--addrs", "x", "y"]
        + ["--verbose", "--no-cache", "--url-flag", "u"]
    )
    assert from_args(Toy, args, internal=8) == Toy("p", 5, 0.5, "b", ("x", "y"), True, False, "u", 8)
    assert from_args(Toy, toy_parser().parse_args(["--path", "p"])) == Toy(path="p")


def test_a_missing_required_flag_or_a_value_outside_the_choices_is_a_usage_error():
    for argv in ([], ["--path", "p", "--mode", "c"]):
        with pytest.raises(SystemExit):
            toy_parser().parse_args(argv)


def test_a_field_type_without_a_flag_type_is_refused():
    @dataclasses.dataclass
    class Bad:
        pairs: dict[str, int] = setting(None, "no flag type")

    with pytest.raises(TypeError, match="pairs"):
        flags(Bad)


def engine_flag(field: dataclasses.Field) -> Flag:
    (flag,) = flags(EngineConfig, only=(field.name,))
    return flag


def other_value(flag: Flag) -> str:
    if flag.name in OTHER_VALUES:
        return OTHER_VALUES[flag.name]
    if flag.choices:
        return next(c for c in flag.choices if c != flag.default)
    return str((flag.default or 1) + 1)


def test_every_engine_field_but_one_is_a_flag():
    assert {f.name for f in dataclasses.fields(EngineConfig)} - {
        f.name for f in dataclasses.fields(EngineConfig) if flags(EngineConfig, only=(f.name,))
    } == NO_FLAG


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_every_engine_setting_has_one_flag_and_one_variable_with_the_fields_default(command):
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in NO_FLAG | {"model"}]
    parser_options = pdserve_options(command)
    variables = {"PDSERVE_" + engine_flag(f).name[2:].upper().replace("-", "_") for f in fields}
    assert len(variables) == len(fields)
    for field in fields:
        flag = engine_flag(field)
        assert parser_options.count(flag.name) == 1, flag.name
        assert flag.default == field.default, field.name
        variable = "PDSERVE_" + flag.name[2:].upper().replace("-", "_")
        env = {variable: "1" if flag.nargs == 0 else other_value(flag)}
        assert flags_from_env(command, env) == [flag.name, *([] if flag.nargs == 0 else [env[variable]])]
    args = build_parser().parse_args([command, "--model", "m"])
    assert from_args(EngineConfig, args) == EngineConfig(model="m")  # every default is the field's


def test_each_engine_variable_reaches_its_field():
    env = {"PDSERVE_MODEL": "m"}
    want = {"model": "m"}
    for field in dataclasses.fields(EngineConfig):
        if field.name in NO_FLAG | {"model"}:
            continue
        flag = engine_flag(field)
        variable = "PDSERVE_" + flag.name[2:].upper().replace("-", "_")
        env[variable] = "yes" if flag.nargs == 0 else other_value(flag)
        value = flag.value_type(env[variable]) if flag.nargs != 0 else None
        want[field.name] = (
            (not field.default) if flag.nargs == 0 else (value,) if flag.nargs == "+" else value
        )
    args = build_parser().parse_args(["decode", *flags_from_env("decode", env)])
    assert dataclasses.asdict(from_args(EngineConfig, args)) == dataclasses.asdict(EngineConfig(**want))


def pdserve_options(command: str) -> list[str]:
    """The option strings of `pdserve COMMAND`'s parser (argparse's internals: in a test only)."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    actions = subparsers.choices[command]._actions
    return [opt for action in actions for opt in action.option_strings if opt not in ("-h", "--help")]


@pytest.mark.parametrize("command", ["router", "prefill", "decode"])
def test_the_container_maps_exactly_the_flags_of_each_service_command(command):
    assert sorted(pdserve_options(command)) == sorted(command_flags(command))


def test_other_commands_run_as_given_and_read_their_own_variables():
    assert flags_from_env("status", {"PDSERVE_CACHE": "/models"}) == []
    # status reads PDSERVE_REDIS itself (its --redis default): passed through, not refused
    assert flags_from_env("status", {"PDSERVE_REDIS": "redis://r:6379/0"}) == []


@pytest.mark.usefixtures("processes")
def test_the_entrypoint_imports_no_cli_module():
    code = (
        "import pdserve.launcher.env_flags, sys; assert 'pdserve.cli' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


@pytest.mark.usefixtures("processes")
def test_the_entrypoint_execs_the_command_with_the_mapped_flags():
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_") or k in NOT_FLAGS}
    env |= {"PDSERVE_MODEL": "/m", "PDSERVE_DECODE": "tcp://a:1", "PDSERVE_PORT": "eighty"}
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.launcher.env_flags", "router"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2  # pdserve's own usage error: the variable became its flag
    assert "argument --port: invalid int value: 'eighty'" in result.stderr
