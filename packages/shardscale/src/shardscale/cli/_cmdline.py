"""Argument parsing shared by every ``shardscale`` command: one error form, one meaning per flag.

[Note: one meaning per flag]
Every command builds its parser with :func:`add_command` and the top level
parses with :func:`parse_command_line`, so that

* every error reads ``shardscale <cmd>: error: <message>`` on stderr, after
  that command's own usage line (never the top-level usage), exit status 2 --
  bad options, unknown options and values refused after parsing alike
  (:func:`command_error` for the last);
* ``--json`` always means JSON on stdout (:func:`add_json_option`), and files
  are written only under the one folder named by ``--out DIR``
  (:func:`add_out_option`);
* ``--mesh``/``--meshes`` read the one grammar of
  :mod:`shardscale.cli._mesh_spec` (:func:`mesh_arg`, :func:`meshes_arg`);
* numbers with a sane range say the range when refused (:func:`bounded_float`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from shardscale.cli._mesh_spec import MeshSpec, MeshSpecError, parse_mesh_list, parse_mesh_spec

__all__ = [
    "USAGE_ERROR",
    "CommandParser",
    "add_command",
    "add_json_option",
    "add_out_option",
    "bounded_float",
    "command_error",
    "mesh_arg",
    "meshes_arg",
    "parse_command_line",
]

#: Exit status of every refused command line (argparse's own choice, kept everywhere).
USAGE_ERROR = 2


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are ``<prog>: error: ...`` after its own usage, exit 2."""

    def error(self, message: str) -> NoReturn:
        """Print this parser's usage and ``<prog>: error: message`` on stderr; exit 2."""
        self.print_usage(sys.stderr)
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n")


def add_command(sub: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """Add subcommand ``name`` to ``sub`` (from ``add_subparsers``) as a :class:`CommandParser`.

    The parser is remembered in the parsed namespace (``command_parser``) so that
    :func:`parse_command_line` reports an unknown option with this command's usage.
    """
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    p.set_defaults(command_parser=p)
    return p


def parse_command_line(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """Parse ``argv``; an unknown option is an error of the subcommand it was given to."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        target: argparse.ArgumentParser = getattr(args, "command_parser", None) or parser
        target.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def command_error(
    args_or_prog: argparse.Namespace | str, message: str, *, stream: TextIO | None = None
) -> int:
    """Print ``shardscale <cmd>: error: message`` (no usage: the line parsed); return 2.

    For values refused after parsing (a mesh that does not fit the world size, an
    unwritable ``--out``). ``args_or_prog`` is the parsed namespace or the prog text.
    """
    if isinstance(args_or_prog, str):
        prog = args_or_prog
    else:
        parser = getattr(args_or_prog, "command_parser", None)
        prog = parser.prog if parser is not None else "shardscale"
    print(f"{prog}: error: {message}", file=stream if stream is not None else sys.stderr)
    return USAGE_ERROR


def add_json_option(parser: argparse.ArgumentParser, *, what: str = "the result") -> None:
    """``--json``: print ``what`` as JSON on stdout instead of text (never a file)."""
    parser.add_argument(
        "--json", action="store_true", help=f"print {what} as JSON on stdout instead of text"
    )


def add_out_option(parser: argparse.ArgumentParser, *, default: Path | None, what: str) -> None:
    """``--out DIR``: the one folder a command writes its files (``what``) into."""
    shown = f" (default {default})" if default is not None else ""
    parser.add_argument(
        "--out", type=Path, default=default, metavar="DIR", help=f"folder for {what}{shown}"
    )


def mesh_arg(text: str) -> MeshSpec:
    """``type=`` for ``--mesh``: one mesh in the grammar of :mod:`shardscale.cli._mesh_spec`."""
    try:
        return parse_mesh_spec(text, option="")
    except MeshSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def meshes_arg(text: str) -> tuple[MeshSpec, ...]:
    """``type=`` for ``--meshes``: comma-separated meshes in the same grammar."""
    try:
        return parse_mesh_list(text, option="")
    except MeshSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def bounded_float(
    low: float, high: float, *, unit: str = "", example: str = ""
) -> Callable[[str], float]:
    """``type=`` for a number in ``[low, high]``; the refusal names the range and an example."""
    unit_text = f" of {unit}" if unit else ""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            hint = f"; e.g. {example}" if example else ""
            raise argparse.ArgumentTypeError(
                f"must be a number{unit_text} from {low:g} to {high:g}, got {text!r}{hint}"
            )
        return value

    parse.__name__ = "number"
    return parse
