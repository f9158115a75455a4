"""The scale table (``nox -s bench_scale``): the step engine simulated at 1 024 to 131 072 ranks.

``python benchmarks/bench_scale.py [--worlds ...] [--repeats N] [--out DIR] [--json]`` from a
clone (``shardscale bench scale`` runs this file when it finds it). The engine runs in this
one process on torch's fake process group (see [Note: simulating W ranks in one process] in
``scale_sim``) and the all-reduce is modelled with NCCL's tuning model (``nccl_model``).
Prints the Markdown table (``--json``: the JSON on stdout, progress on stderr); writes
``bench-scale.json`` and ``bench-scale.md`` into ``--out``. Not part of any wheel: the
simulator and the model are a lab, not a tool users install.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None, *, prog: str = "bench_scale.py") -> int:
    """Run the table; 0 when every simulated decision was correct, 1 otherwise, 2 on bad options."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from scale_table import DEFAULT_WORLDS, format_scale_markdown, run_scale_table, write_scale

    parser = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--worlds",
        type=int,
        nargs="+",
        default=list(DEFAULT_WORLDS),
        help="world sizes to simulate (multiples of 8, at least 16; default 1024 ... 131072)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per simulated rank")
    parser.add_argument("--quick", action="store_true", help="smoke run: 16 and 32 ranks, 2 steps")
    parser.add_argument("--out", type=Path, default=Path("shardscale-bench"), metavar="DIR",
                        help="folder for bench-scale.json and bench-scale.md")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the JSON on stdout")
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.repeats = [16, 32], 2
    bad = [w for w in args.worlds if w < 16 or w % 8]
    if bad:
        parser.error(f"--worlds {bad}: the model needs whole nodes of 8 ranks, at least two")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: time at least one step")
    human = sys.stderr if args.json else sys.stdout
    result = run_scale_table(
        args.worlds, repeats=args.repeats, log=lambda s: print(s, file=sys.stderr, flush=True)
    )
    js, md = write_scale(result, args.out)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_scale_markdown(result), file=human)
    print(f"wrote {js} and {md}", file=human)
    ok = all(
        r["host"]["clean"]["correct"] and r["host"]["inf_on_last"]["correct"]
        for r in result["rows"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
