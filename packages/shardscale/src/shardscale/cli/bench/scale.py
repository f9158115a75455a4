"""``python -m shardscale.cli.bench.scale``: the scale table (``nox -s bench_scale``).

The step engine simulated at 1 024 to 131 072 ranks in this one process on
torch's fake process group (see [Note: simulating W ranks in one process]
in ``_scale_sim``) and the all-reduce modelled with NCCL's tuning model
(``_nccl_model``). Prints the Markdown table; writes ``bench-scale.json``
and ``bench-scale.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the table; 0 when every simulated decision was correct, 1 otherwise."""
    from shardscale.cli.bench._scale_table import (
        DEFAULT_WORLDS,
        format_scale_markdown,
        run_scale_table,
        write_scale,
    )

    parser = argparse.ArgumentParser(prog="python -m shardscale.cli.bench.scale")
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=list(DEFAULT_WORLDS),
        help="world sizes to simulate (multiples of 8, at least 16; default 1024 ... 131072)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per simulated rank")
    parser.add_argument("--out", type=Path, default=Path("shardscale-bench"))
    args = parser.parse_args(argv)
    bad = [w for w in args.worlds if w < 16 or w % 8]
    if bad:
        parser.error(f"--worlds {bad}: the model needs whole nodes of 8 ranks, at least two")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: time at least one step")
    result = run_scale_table(args.worlds, repeats=args.repeats, log=lambda s: print(s, flush=True))
    print(format_scale_markdown(result))
    js, md = write_scale(result, args.out)
    print(f"wrote {js} and {md}")
    ok = all(
        r["host"]["clean"]["correct"] and r["host"]["inf_on_last"]["correct"]
        for r in result["rows"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
