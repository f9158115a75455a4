"""foreach against Triton stats kernels on one CUDA device: time, launches and host syncs.

Run it as ``nox -s bench_kernels`` on a machine with a GPU (never part of CI).
For a list of gradients shaped like a transformer's (many small tensors beside
a few large ones) it measures, per kernels plugin, the step engine's read (the
per-tensor norms) and its apply (the in-place multiply), and the whole step
through :func:`shardscale.core.step.run_step`, plus torch's recipe
(``_amp_foreach_non_finite_check_and_unscale_`` + ``clip_grad_norm_``):

* time: median and interquartile range over ``--repeats`` CUDA-event timings,
  after warm-up (compilation and the Triton self-check happen there);
* kernel launches: the CUDA kernels one call issues, from ``torch.profiler``;
* host syncs: each measured call also runs once under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises on a sync
  (both from ``shardscale.cli.bench._launches``, which ``shardscale bench``
  uses for its own launch and sync columns).

With ``--interpret`` it runs every case once on small CPU tensors through
Triton's interpreter and measures nothing (no times, launches or syncs exist
there): a smoke test of this script. Its numbers have never been taken: no GPU
was available when it was written.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any


def _shapes(layers: int, width: int) -> list[int]:
    sizes = [50_000 * width]  # embedding
    for _ in range(layers):
        sizes += [width, width, 3 * width * width, 3 * width, width * width, width]
        sizes += [width, width, 4 * width * width, 4 * width, 4 * width * width, width]
    return sizes


def _time(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, float, float]:
    import torch

    if device != "cuda":
        return (math.nan, math.nan, math.nan)
    samples = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)  # microseconds
    q = statistics.quantiles(samples, n=4)
    return (statistics.median(samples), q[0], q[2])


def _launches(fn: Callable[[], Any], device: str) -> int:
    from shardscale.cli.bench._launches import count_launches

    return count_launches(fn, device) if device == "cuda" else -1


def _no_sync(fn: Callable[[], Any], device: str) -> str:
    from shardscale.cli.bench._launches import host_sync

    found = host_sync(fn, device)
    return "none" if found is None else found if found == "n/a" else f"SYNC: {found}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run (no timings)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["SHARDSCALE_TRITON_INTERPRET"] = "1"
        args.layers, args.width, args.repeats = 1, 16, 1
    import torch

    from shardscale.core import get_registry
    from shardscale.core.step import Apply, StepConfig, StepRequest, run_step

    device = "cpu" if args.interpret else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run this on a GPU machine (or pass --interpret)", file=sys.stderr)
        return 2
    registry = get_registry()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(n, generator=gen).to(device, dtype) for n in _shapes(args.layers, args.width)
    ]
    scale = torch.full((), 1024.0, device=device)
    coef = torch.full((), 0.5, device=device)
    numel = sum(g.numel() for g in grads)
    print(f"{len(grads)} gradients, {numel / 1e6:.1f} M elements, {args.dtype}, {device}")
    rows = []
    for name in ("foreach", "triton"):
        kernels = registry.kernels_for(torch.device(device), name)
        config = StepConfig(backend=registry.make_backend("local"), registry=registry, kernels=name)
        cases: dict[str, Callable[[], Any]] = {
            "norms (p=2)": lambda k=kernels: k.tensor_norms(grads, 2.0),
            "multiply": lambda k=kernels: k.mul_(grads, coef),
            "step (unscale+clip)": lambda c=config: run_step(
                grads,
                c,
                StepRequest(
                    apply=Apply.MULTIPLY, norm_type=2.0, max_norm=1.0, scale=scale, as_grads=True
                ),
            ),
        }
        for label, fn in cases.items():
            for _ in range(3):
                fn()  # warm-up: compilation, self-check, cached tables
            rows.append((name, label, _time(fn, device, args.repeats), _launches(fn, device),
                         _no_sync(fn, device)))  # fmt: skip

    # torch's recipe takes parameters: give each gradient one of its shape.
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g

    def torch_step() -> None:
        found = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.reciprocal())
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    for _ in range(3):
        torch_step()
    rows.append(("torch", "unscale_ + clip_grad_norm_", _time(torch_step, device, args.repeats),
                 _launches(torch_step, device), "n/a (torch's recipe)"))  # fmt: skip
    print(f"{'kernels':8} {'what':28} {'median us':>10} {'IQR us':>17} {'launches':>8}  host syncs")
    for name, label, (med, lo, hi), launches, syncs in rows:
        print(f"{name:8} {label:28} {med:10.1f} {lo:8.1f}-{hi:<8.1f} {launches:8d}  {syncs}")
    if args.json:
        import json

        fields = ("kernels", "what", "median_us", "q1_us", "q3_us", "launches", "host_syncs")
        records = [dict(zip(fields, (n, w, *t, k, y), strict=True)) for n, w, t, k, y in rows]
        meta = {"gradients": len(grads), "elements": numel, "dtype": args.dtype, "device": device}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**meta, "rows": records}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
