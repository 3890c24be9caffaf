"""docs/flags.md: every `pdserve` command's flags, generated from the parser the command line builds.

The parser is the one source: it holds the flags that config dataclasses declare with
``protocol.settings.setting`` (EngineConfig, NodeOptions, RouterConfig) and the commands' own, so
the page cannot list a flag the command lacks. tests/test_docs.py fails when docs/flags.md differs
from what this prints.

    python -m scripts.flag_reference            # print the page
    python -m scripts.flag_reference --write    # rewrite docs/flags.md

The output is the same on every machine and from any directory: the parser is built with no
``PDSERVE_*`` variable set (some flags take their default from one, an API key among them), and a
default that depends on the machine is a ``None`` whose help text says how it is chosen.
argparse has no public way to list a parser's arguments, so this reads its ``_actions``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import sys
from collections.abc import Iterator
from unittest import mock

from pdserve.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "flags.md"

HEADER = """\
# Flag reference

Every flag of every `pdserve` command, with its default. This page is generated from the parser
the command line builds (`pdserve.cli.main.build_parser`), which takes most flags from the
settings declared on the config dataclasses (`protocol/settings.py`): do not edit it by hand. After
changing a flag, run `python -m scripts.flag_reference --write`; `tests/test_docs.py` fails while
this page is stale. [serving.md](serving.md) explains the flags by topic.

Defaults are shown as they are with no `PDSERVE_*` variable set. A few flags take their default
from one (their help says which); in a container every `PDSERVE_*` variable sets the flag of the
same name ([deployment.md](deployment.md)). "switch" is a flag that takes no value; "—" is no
default (the flag is off, or its help says how the value is chosen).
"""

UNNAMED_GROUPS = ("positional arguments", "options", "optional arguments")  # argparse's own titles
SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


@dataclasses.dataclass(frozen=True, slots=True)
class Command:
    path: tuple[str, ...]  # ("plan", "calibrate") for `pdserve plan calibrate`
    summary: str  # the one line its parent's --help lists it with
    parser: argparse.ArgumentParser

    @property
    def name(self) -> str:
        return "pdserve " + " ".join(self.path)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's parser, built as on a machine with no PDSERVE_* variables."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        return cli.build_parser()


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[Command]:
    """Every command in the order `pdserve --help` lists them, nested ones after their parent."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield Command((*path, name), summaries.get(name, ""), sub)
                yield from commands(sub, (*path, name))


def own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's flags and positionals, without --help and without its subcommands."""
    skipped = (argparse._HelpAction, argparse._SubParsersAction, argparse._VersionAction)
    return [a for a in parser._actions if not isinstance(a, skipped)]


def cell(text: str) -> str:
    """One line of a Markdown table cell: whitespace collapsed, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def flag_cell(action: argparse.Action) -> str:
    if action.choices is not None:
        value = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif action.metavar is not None:
        value = str(action.metavar)
    else:
        value = ""
    if action.nargs == "+" and value:
        value += "..."
    if not action.option_strings:  # a positional: its name, then the values it takes
        return f"`{action.dest.upper()} {value}`" if action.choices else f"`{value or action.dest.upper()}`"
    names = ", ".join(action.option_strings)
    return f"`{names} {value}`" if value else f"`{names}`"


def default_cell(action: argparse.Action) -> str:
    if action.required or not action.option_strings:
        return "required"
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action, SWITCHES) or action.nargs == 0:
        return "switch"
    default = action.default
    if default is None or default == () or default is argparse.SUPPRESS:
        return "—"
    return f"`{default}`" if str(default) else '`""`'


def help_cell(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """The help text with %(default)s and the like filled in as --help fills them (argparse's own
    expansion, repeated here so that no formatter's width or colours reach the page)."""
    if not action.help:
        return ""
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    params = {k: getattr(v, "__name__", v) for k, v in params.items()}  # type=int reads "int"
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return cell(action.help % params)


def table(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> list[str]:
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    rows += [f"| {flag_cell(a)} | {default_cell(a)} | {help_cell(parser, a)} |" for a in actions]
    return [*rows, ""]


def command_section(command: Command) -> list[str]:
    parser = command.parser
    lines = [f"## `{command.name}`", ""]
    if parser.description:
        lines += [cell(parser.description), ""]
    actions = own_actions(parser)
    # argparse's own groups (positionals, options) make one table; a command's named groups follow
    named = [g for g in parser._action_groups if g.title not in UNNAMED_GROUPS]
    in_named = {a for g in named for a in g._group_actions}
    lines += table(parser, [a for a in actions if a not in in_named])
    for group in named:
        grouped = [a for a in group._group_actions if a in actions]
        if grouped:
            lines += [f"### `{command.name}`: {group.title}", "", *table(parser, grouped)]
    for exclusive in parser._mutually_exclusive_groups:
        names = ", ".join(f"`{a.option_strings[0]}`" for a in exclusive._group_actions)
        lines += [f"{'Exactly' if exclusive.required else 'At most'} one of {names}.", ""]
    return lines


def render() -> str:
    """The whole page."""
    listed = [c for c in commands(build_parser()) if own_actions(c.parser)]  # not `pdserve plan` itself
    lines = [HEADER, "| command | |", "|---|---|"]
    for command in listed:
        anchor = command.name.replace(" ", "-")  # the heading's anchor, as GitHub makes it
        lines.append(f"| [`{command.name}`](#{anchor}) | {cell(command.summary)} |")
    lines.append("")
    for command in listed:
        lines += command_section(command)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    write = parser.parse_args(argv).write
    text = render()
    if write:
        OUT.write_text(text)
        print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
