"""Test-only shardscale plugin (shardscale-bad-argparse): parses sys.argv when imported, so it exits on the user's own flags."""

from __future__ import annotations

import argparse

# The mistake: a module that parses the command line when it is imported.
_parser = argparse.ArgumentParser(prog="bad_argparse")
_parser.add_argument("--bad-argparse-verbose", action="store_true")
OPTIONS = _parser.parse_args()
