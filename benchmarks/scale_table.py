"""The scale table: the simulated step (``scale_sim``) and the modelled all-reduce (``nccl_model``).

One row per world size: the reduced vector's bytes, the host time of one
step (collect, read, build the vector, reduce, decide) with its 95 %
interval, whether every simulated rank decided correctly with and without an
inf on the last rank, and the modelled all-reduce time of the vector against
an 8-byte one. Modelled numbers are labelled *derived* in the JSON.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from nccl_model import Fabric, allreduce_us
from scale_sim import SimConfig, SimResult, median_interval, simulate

__all__ = ["DEFAULT_WORLDS", "ScaleRow", "format_scale_markdown", "run_scale_table", "scale_row"]

#: 1 024 to 131 072 ranks, doubling.
DEFAULT_WORLDS = tuple(1024 * 2**k for k in range(8))


@dataclass(frozen=True, slots=True)
class ScaleRow:
    """One world size of the table."""

    clean: SimResult
    overflow: SimResult
    fabric: Fabric

    def as_json(self) -> dict[str, Any]:
        """The row's numbers; modelled ones under ``model_derived``."""
        world = self.clean.world
        vec = allreduce_us(self.clean.vector_bytes, world, self.fabric)
        eight = allreduce_us(8, world, self.fabric)
        host = {}
        for name, res in (("clean", self.clean), ("inf_on_last", self.overflow)):
            mid, low, high = median_interval(res.step_s)
            host[name] = {
                "median_ms": mid * 1e3,
                "ci95_ms": [low * 1e3, high * 1e3],
                "samples_ms": [s * 1e3 for s in res.step_s],
                "decisions": {str(r): list(d) for r, d in res.decisions.items()},
                "collectives_per_step": res.collectives_per_step,
                "correct": res.correct,
            }
        return {
            "world": world,
            "vector_numel": self.clean.vector_numel,
            "vector_bytes": self.clean.vector_bytes,
            "reference_norm": self.clean.reference,
            "norm_rtol": self.clean.rtol,
            "host": host,
            "model_derived": {
                "vector_us": vec.us,
                "vector_algo": f"{vec.algo}/{vec.proto}",
                "eight_bytes_us": eight.us,
                "eight_bytes_algo": f"{eight.algo}/{eight.proto}",
                "ratio": vec.us / eight.us,
            },
        }


def scale_row(world: int, *, repeats: int = 15, fabric: Fabric | None = None) -> ScaleRow:
    """Simulate ``world`` ranks twice (finite gradients; an inf on the last rank)."""
    clean = simulate(SimConfig(world=world, repeats=repeats))
    overflow = simulate(SimConfig(world=world, repeats=repeats, inf_on_last=True))
    return ScaleRow(clean=clean, overflow=overflow, fabric=fabric or Fabric())


def run_scale_table(
    worlds: Sequence[int] = DEFAULT_WORLDS,
    *,
    repeats: int = 15,
    fabric: Fabric | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every row, with the machine it ran on (the JSON ``bench_scale.py`` writes)."""
    torch.set_num_threads(1)  # as one rank of the benchmark: one thread
    fabric = fabric or Fabric()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for world in worlds:
        t0 = time.perf_counter()
        row = scale_row(world, repeats=repeats, fabric=fabric).as_json()
        rows.append(row)
        log(f"world {world}: {time.perf_counter() - t0:.1f} s")
    return {
        "schema": "shardscale-bench-scale/1",
        "started": started,
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "threads": 1,
        },
        "fabric_assumed": {
            "gpus_per_node": fabric.gpus_per_node,
            "channels": fabric.channels,
            "bw_inter_per_channel_GBps": fabric.bw_inter_per_channel,
        },
        "repeats_per_rank": repeats,
        "rows": rows,
    }


def _ms(host: dict[str, Any]) -> str:
    low, high = host["ci95_ms"]
    return f"{host['median_ms']:.2f} [{low:.2f}, {high:.2f}]"


def format_scale_markdown(result: dict[str, Any]) -> str:
    """The table as Markdown (docs/benchmark.md)."""
    lines = [
        "| ranks | vector bytes | host ms / step, finite [95 % CI] | host ms / step, inf on "
        "last rank [95 % CI] | decisions correct | collectives / step | all-reduce µs, vector "
        "(model) | all-reduce µs, 8 bytes (model) | ratio (model) |",
        "| ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result["rows"]:
        model = row["model_derived"]
        ok = row["host"]["clean"]["correct"] and row["host"]["inf_on_last"]["correct"]
        calls = {row["host"][k]["collectives_per_step"] for k in ("clean", "inf_on_last")}
        lines.append(
            f"| {row['world']:,} | {row['vector_bytes']:,} | {_ms(row['host']['clean'])} | "
            f"{_ms(row['host']['inf_on_last'])} | {'yes' if ok else 'NO'} | "
            f"{'/'.join(f'{c:g}' for c in sorted(calls))} | "
            f"{model['vector_us']:.1f} ({model['vector_algo']}) | "
            f"{model['eight_bytes_us']:.1f} ({model['eight_bytes_algo']}) | {model['ratio']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def write_scale(result: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """``bench-scale.json`` and ``bench-scale.md`` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    js, md = out / "bench-scale.json", out / "bench-scale.md"
    js.write_text(json.dumps(result, indent=1) + "\n")
    md.write_text(format_scale_markdown(result))
    return js, md
