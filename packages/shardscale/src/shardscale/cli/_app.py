"""The ``shardscale`` command line: ``demo``, ``bench``, ``plugins``, ``doctor``, ``env``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

__all__ = ["build_parser", "main"]


def _version() -> str:
    try:
        return metadata.version("shardscale")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per command."""
    from shardscale.cli._bench_cmd import add_bench_parser
    from shardscale.cli._cmdline import CommandParser
    from shardscale.cli._demo import add_demo_parser
    from shardscale.cli._doctor import add_doctor_parser
    from shardscale.cli._env import add_env_parser
    from shardscale.cli._plugins_cmd import add_plugins_parser

    parser = CommandParser(
        prog="shardscale",
        description="Mixed-precision training helpers for sharded PyTorch models. Start with "
        "'shardscale demo'.",
    )
    parser.add_argument("--version", action="version", version=f"shardscale {_version()}")
    sub = parser.add_subparsers(
        title="commands", dest="command", metavar="COMMAND", parser_class=CommandParser
    )
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_plugins_parser(sub)
    add_doctor_parser(sub)
    add_env_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``shardscale`` console script and ``python -m shardscale.cli``."""
    from shardscale.cli._cmdline import parse_command_line

    parser = build_parser()
    args = parse_command_line(parser, argv)
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.func(args)
    sys.stdout.flush()
    return status
