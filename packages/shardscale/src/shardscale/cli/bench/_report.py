"""From raw samples to intervals, and from results to text, Markdown and JSON.

Every figure printed comes from the JSON of a run: :func:`analyse` adds the
medians and intervals to the raw samples, :func:`format_table` and
:func:`format_markdown` only format, so ``shardscale bench --from-json`` gives
the same tables as the run that wrote the file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shardscale.cli.bench._passes import floor_passes, floor_ratio
from shardscale.cli.bench._stats import median, ratio_interval

__all__ = ["analyse", "format_markdown", "format_ranges", "format_table", "sanitize", "write_json"]

_METRICS = ("step", "post", "backward")
_LABEL = {"torch": "torch", "torch_aa": "torch again (A/A)", "ours": "ours",
          "ours_fuse_optimizer": "ours, fuse_optimizer=True",
          "ours_streaming": "ours + streaming stats", "ours_foreach": "ours, foreach kernels",
          "streaming_vs_ours": "streaming / ours (not / torch)"}  # fmt: skip


_VS = "streaming_vs_ours"


def _ratios(row: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ratios of arm ``name`` against torch, or of streaming against ours for ``_VS``."""
    if name == _VS:
        vs: dict[str, Any] | None = row.get(_VS)
        return vs
    arm = row["arms"].get(name)
    return None if arm is None else arm.get("ratio")


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    """Add medians and ratio intervals (every arm against ``torch``, paired by round) in place."""
    cfg = result["config"]
    for row in result.get("rows", []):
        ref = row["arms"]["torch"]
        for name, arm in row["arms"].items():
            arm["median_ms"] = {m: median(arm[f"{m}_ms"]) for m in _METRICS}
            local = row.get("local_grad_bytes") or 0
            arm["grad_passes_derived"] = (
                [arm["grad_bytes_read"] / local, arm["grad_bytes_written"] / local]
                if local else None
            )  # fmt: skip
            arm.update(_passes(arm, name, row["optimizer"], local))
            if name == "torch":
                continue
            arm["ratio"] = {
                m: ratio_interval(
                    arm[f"{m}_ms"], ref[f"{m}_ms"], seed=cfg["seed"], resamples=cfg["resamples"]
                ).as_dict()
                for m in _METRICS
            }
        if "torch_aa" in row["arms"]:
            row["aa"] = row["arms"]["torch_aa"]["ratio"]
        if {"ours", "ours_streaming"} <= set(row["arms"]):
            # With and without streaming statistics, paired by round: what the hooks buy.
            row["streaming_vs_ours"] = {
                m: ratio_interval(
                    row["arms"]["ours_streaming"][f"{m}_ms"], row["arms"]["ours"][f"{m}_ms"],
                    seed=cfg["seed"], resamples=cfg["resamples"],
                ).as_dict()
                for m in _METRICS
            }  # fmt: skip
    return result


def _passes(arm: dict[str, Any], name: str, optimizer: str, local: int) -> dict[str, Any]:
    """Gradient-sized passes counted (gradients + parameters + optimizer state) and the floor."""
    counted = None
    if local and "state_bytes_read" in arm:  # runs before the state was counted have no passes
        total = (arm["grad_bytes_read"] + arm["grad_bytes_written"] + arm["state_bytes_read"]
                 + arm["state_bytes_written"])  # fmt: skip
        counted = total / local
    return {
        "passes_derived": counted,
        "pass_floor": floor_passes(name, optimizer),
        "pass_floor_ratio": floor_ratio(name, optimizer),
    }


def _passes_cell(arm: dict[str, Any]) -> str:
    """``counted (floor F -> ratio R)``; torch's floor is its own count, so only the count."""
    counted = _num(arm.get("passes_derived"), ".1f")
    floor, ratio = arm.get("pass_floor"), arm.get("pass_floor_ratio")
    if floor is None or ratio is None or ratio == 1:
        return counted
    return f"{counted} (floor {floor} -> {_num(ratio)})"


def _sync(value: Any) -> str:
    return "none" if value is None else str(value)


def _launch_lines(result: dict[str, Any], *, markdown: bool) -> list[str]:
    """Launches and host syncs of one post-processing step per arm (see ``_launches``)."""
    rows = [
        r for r in result.get("rows", []) if any("launches_post" in a for a in r["arms"].values())
    ]
    if not rows:
        return []
    kinds = {a.get("launches_counted_as") for r in rows for a in r["arms"].values()} - {None}
    out = ["", f"Launches per post-processing step ({', '.join(sorted(kinds))}) and host syncs "
           "(set_sync_debug_mode('error'); clip = unscale + clip alone, post = with step and update):"]  # fmt: skip
    if markdown:
        out += ["", "| mesh | optimizer | arm | launches | host sync in clip | host sync in post |",
                "| --- | --- | --- | ---: | --- | --- |"]  # fmt: skip
    for row in rows:
        for name, arm in row["arms"].items():
            if "launches_post" not in arm:
                continue
            cells = [_mesh(row), row["optimizer"], _LABEL.get(name, name), str(arm["launches_post"]),
                     _sync(arm.get("host_sync_clip")), _sync(arm.get("host_sync_post"))]  # fmt: skip
            out.append("| " + " | ".join(cells) + " |" if markdown else "  " + "; ".join(cells))
    return out


def sanitize(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no nan or inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitize(v) for v in value]
    return value


def write_json(result: dict[str, Any], path: Path) -> Path:
    """Write ``result`` to ``path`` atomically (a reader never sees half a file)."""
    text = json.dumps(sanitize(result), indent=1, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the results from others
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _num(x: Any, fmt: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _ci(r: dict[str, Any] | None) -> str:
    if r is None:
        return "1 (reference)"
    return f"{_num(r['ratio'])} [{_num(r['low'])}, {_num(r['high'])}]"


def _mib(n: Any) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def _mesh(row: dict[str, Any]) -> str:
    dims = row.get("mesh_dims", [])
    shape = " x ".join(f"{d}{s}" for d, s in zip(dims, row["mesh_shape"], strict=False))
    return f"{row['mesh']} ({shape})"


def _bytes(arm: dict[str, Any]) -> str:
    text = f"{_mib(arm['grad_bytes_read'])}/{_mib(arm['grad_bytes_written'])}"
    if arm.get("grad_bytes_read_in_backward_hooks"):
        text += f" +{_mib(arm['grad_bytes_read_in_backward_hooks'])} R in hooks"
    return text


def _heading(result: dict[str, Any]) -> list[str]:
    cfg, env = result["config"], result["environment"]
    row0 = result["rows"][0] if result.get("rows") else None
    machine = (
        f"world size {cfg['world_size']} over {env['collective_library']}, "
        f"{env['device']} ({env['machine']}, {env['cpu_count']} CPUs, load average "
        f"{env.get('load_average_start')} -> {env.get('load_average_end')}), torch {env['torch']}, "
        f"{env['torch_num_threads']} thread(s) per rank"
    )
    if row0 is None:
        return [f"shardscale bench ({result.get('started', '?')}), scaling table only: {machine}"]
    return [
        f"shardscale bench ({result.get('started', '?')}): {cfg['n_params'] / 1e6:.1f}M-parameter "
        f"FSDP2 model, {machine}",
        f"{row0['rounds']} measured rounds per arm after {row0['warmup_rounds']} warm-up, arms in a balanced (Williams) order; step = forward + backward (hooks "
        "included) + post; post = unscale + clip + step + update; the slowest rank per round",
        f"ratio = median(arm) / median(torch), [95 % paired bootstrap interval, "
        f"{cfg['resamples']} resamples, seed {cfg['seed']}]; a ratio is called faster/slower only "
        "when its interval excludes 1",
        "coll. = collectives per step (ours: counting middleware, torch: CommDebugMode); grad "
        "MiB R/W = gradient memory read/written by post + step, counted per aten op on rank "
        f"{row0.get('counts_from_rank', 0)}; passes = gradient-sized reads + writes of "
        "gradients, parameters and optimizer state, counted the same way; floor = the fewest "
        "for that recipe (docs/benchmark.md), -> its ratio to torch's passes",
    ]


def _verdict(r: dict[str, Any] | None) -> str:
    return "" if r is None else str(r["verdict"])


def format_table(result: dict[str, Any]) -> str:
    """The main table, the A/A line and the scaling table as plain text."""
    lines = [*_heading(result), ""]
    if result.get("rows"):
        head = (f"{'mesh':<16}{'optimizer':<12}{'arm':<24}{'step ms':>9}  {'step ratio [95% CI]':<22}"
                f"{'verdict':<24}{'post ms':>9}  {'post ratio [95% CI]':<22}{'verdict':<24}"
                f"{'coll.':>6}  {'passes (floor -> ratio)':<26}grad MiB R/W")  # fmt: skip
        lines += [head, "-" * len(head)]
        for row in result["rows"]:
            for name, arm in row["arms"].items():
                r = arm.get("ratio")
                lines.append(
                    f"{_mesh(row):<16}{row['optimizer']:<12}{_LABEL.get(name, name):<24}"
                    f"{_num(arm['median_ms']['step'], '.1f'):>9}  {_ci(r and r['step']):<22}"
                    f"{_verdict(r and r['step']):<24}{_num(arm['median_ms']['post'], '.2f'):>9}  "
                    f"{_ci(r and r['post']):<22}{_verdict(r and r['post']):<24}"
                    f"{arm['collectives']:>6}  {_passes_cell(arm):<26}{_bytes(arm)}"
                )
        lines += ["", "A/A (torch against itself, the noise floor of this run):"]
        for row in result["rows"]:
            if "aa" in row:
                lines.append(
                    f"  {_mesh(row)} {row['optimizer']}: step {_ci(row['aa']['step'])}, "
                    f"post {_ci(row['aa']['post'])}"
                )
        lines += [
            "",
            "Streaming statistics against plain unscale_and_clip_ (ours + streaming / ours):",
        ]
        for row in result["rows"]:
            if "streaming_vs_ours" in row:
                sv = row["streaming_vs_ours"]
                lines.append(
                    f"  {_mesh(row)} {row['optimizer']}: step {_ci(sv['step'])} "
                    f"{sv['step']['verdict']}, backward {_ci(sv['backward'])} "
                    f"{sv['backward']['verdict']}, post {_ci(sv['post'])} {sv['post']['verdict']}"
                )
    lines += _launch_lines(result, markdown=False)
    if result.get("scaling"):
        lines += ["", *_scaling_lines(result["scaling"])]
    return "\n".join(lines)


def _mmm(s: dict[str, Any], unit: float, fmt: str) -> str:
    return "/".join(
        _num(s[k] * unit if s[k] is not None else None, fmt) for k in ("min", "median", "max")
    )


def _scaling_lines(sc: dict[str, Any]) -> list[str]:
    lines = [
        f"scaling: unscale + clip vs FSDP2 parameters ({sc['param_numel']} elements each), 1-D mesh "
        f"of {sc['mesh_shape'][0]} ranks; cold = first call on a new layout "
        f"({sc['cold_repeats']}+ samples, min/median/max), warm = same layout again "
        f"({sc['warm_repeats']} samples, ABBA)",
        f"{'params':>7}  {'torch cold s':<22}{'ours cold s':<22}{'cold ratio':>18}  "
        f"{'torch warm ms':>14}{'ours warm ms':>14}  {'warm ratio [95% CI]':<22}verdict",
    ]
    for p in sc["points"]:
        if "skipped" in p:
            lines.append(f"{p['n_params']:>7}  skipped: {p['skipped']}")
            continue
        t, o = p["arms"]["torch"], p["arms"]["ours"]
        lines.append(
            f"{p['n_params']:>7}  {_mmm(t['cold'], 1, '.3f'):<22}{_mmm(o['cold'], 1, '.3f'):<22}"
            f"{_num(p['cold_ratio_derived'], '.3f') + ' (derived)':>18}  "
            f"{_num(t['warm']['median'] * 1e3, '.2f'):>14}{_num(o['warm']['median'] * 1e3, '.2f'):>14}  "
            f"{_ci(p['warm_ratio']):<22}{p['warm_ratio']['verdict']}"
        )
    return lines


def format_markdown(result: dict[str, Any]) -> str:
    """The README's tables (main, A/A, scaling) from one run's JSON."""
    env, cfg = result["environment"], result["config"]
    out = [
        f"Run of {result.get('started', '?')}: {cfg['n_params'] / 1e6:.1f}M parameters, world size "
        f"{cfg['world_size']} ({env['collective_library']}), {env['machine']} with {env['cpu_count']} "
        f"CPUs (shared; load average {env.get('load_average_start')} at the start), torch "
        f"{env['torch']}, {env['torch_num_threads']} thread(s) per rank.",
        "",
    ]
    if result.get("rows"):
        out += [
            "| mesh | optimizer | arm | step ms | step ratio [95 % CI] | post ms | post ratio [95 % CI] "
            "| collectives / step | passes / step (floor -> ratio) | grad MiB read/written |",
            "| --- | --- | --- | ---: | --- | ---: | --- | ---: | --- | --- |",
        ]
        for row in result["rows"]:
            for name, arm in row["arms"].items():
                r = arm.get("ratio")
                step = f"{_ci(r['step'])} {r['step']['verdict']}" if r else "1 (reference)"
                post = f"{_ci(r['post'])} {r['post']['verdict']}" if r else "1 (reference)"
                out.append(
                    f"| {_mesh(row)} | {row['optimizer']} | {_LABEL.get(name, name)} | "
                    f"{_num(arm['median_ms']['step'], '.1f')} | {step} | "
                    f"{_num(arm['median_ms']['post'], '.2f')} | {post} | {arm['collectives']} | "
                    f"{_passes_cell(arm)} | {_bytes(arm)} |"
                )
    vs_rows = [row for row in result.get("rows", []) if _VS in row]
    if vs_rows:
        out += ["", "With and without streaming statistics (ours + streaming / ours, paired):", ""]
        for row in vs_rows:
            sv = row[_VS]
            out.append(
                f"- {_mesh(row)} {row['optimizer']}: whole step {_ci(sv['step'])} "
                f"{sv['step']['verdict']}; backward {_ci(sv['backward'])}; post {_ci(sv['post'])} "
                f"{sv['post']['verdict']}"
            )
    out += _launch_lines(result, markdown=True)
    if result.get("scaling"):
        sc = result["scaling"]
        out += [
            "",
            f"Scaling (unscale + clip, {sc['param_numel']}-element FSDP2 parameters, "
            f"{sc['mesh_shape'][0]} ranks; cold = first call on a new layout, min/median/max of "
            f"{sc['cold_repeats']}; warm = median of {sc['warm_repeats']}):",
            "",
            "| params | torch cold s | ours cold s | cold ratio (derived) | torch warm ms | ours warm ms "
            "| warm ratio [95 % CI] |",
            "| ---: | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for p in sc["points"]:
            if "skipped" in p:
                out.append(f"| {p['n_params']} | skipped: {p['skipped']} | | | | | |")
                continue
            t, o = p["arms"]["torch"], p["arms"]["ours"]
            out.append(
                f"| {p['n_params']} | {_mmm(t['cold'], 1, '.3f')} | {_mmm(o['cold'], 1, '.3f')} | "
                f"{_num(p['cold_ratio_derived'], '.3f')} | {_num(t['warm']['median'] * 1e3, '.2f')} | "
                f"{_num(o['warm']['median'] * 1e3, '.2f')} | {_ci(p['warm_ratio'])} "
                f"{p['warm_ratio']['verdict']} |"
            )
    return "\n".join(out)


def _span(values: Sequence[float | None], fmt: str = ".2f") -> str:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "n/a"
    lo, hi = min(vals), max(vals)
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def format_ranges(results: Sequence[dict[str, Any]]) -> str:
    """Ranges (min-max over runs) of every ratio, interval bound and count, as Markdown."""
    out = [
        f"Ranges over {len(results)} runs ({', '.join(str(r.get('started', '?')) for r in results)}):",
        "",
        "| mesh | optimizer | arm | step ratio | step intervals (union) | post ratio | post "
        "intervals (union) | verdicts (step; post) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    keys: list[tuple[str, str, str]] = []
    for res in results:
        for row in res.get("rows", []):
            for name in [*row["arms"], _VS]:
                if name != "torch" and (row["mesh"], row["optimizer"], name) not in keys:
                    keys.append((row["mesh"], row["optimizer"], name))
    for mesh, opt, name in keys:
        ratios = [
            r
            for res in results
            for row in res.get("rows", [])
            if row["mesh"] == mesh and row["optimizer"] == opt
            for r in [_ratios(row, name)]
            if r is not None
        ]
        if not ratios:
            continue
        cells = []
        for m in ("step", "post"):
            lows = [r[m]["low"] for r in ratios if r[m]["low"] is not None]
            highs = [r[m]["high"] for r in ratios if r[m]["high"] is not None]
            union = f"[{_num(min(lows, default=None))}, {_num(max(highs, default=None))}]"
            cells += [_span([r[m]["ratio"] for r in ratios]), union]
        verdicts = "; ".join(
            "/".join(sorted({r[m]["verdict"] for r in ratios})) for m in ("step", "post")
        )
        out.append(
            f"| {mesh} | {opt} | {_LABEL.get(name, name)} | {' | '.join(cells)} | {verdicts} |"
        )
    points: dict[int, list[dict[str, Any]]] = {}
    for res in results:
        for p in (res.get("scaling") or {}).get("points", []):
            if "skipped" not in p:
                points.setdefault(p["n_params"], []).append(p)
    if points:
        out += ["", "| params | torch cold s (medians) | ours cold s (medians) | warm ratio |",
                "| ---: | --- | --- | --- |"]  # fmt: skip
        for n in sorted(points):
            ps = points[n]
            out.append(
                f"| {n} ({len(ps)} runs) | {_span([p['arms']['torch']['cold']['median'] for p in ps], '.3f')} | "
                f"{_span([p['arms']['ours']['cold']['median'] for p in ps], '.3f')} | "
                f"{_span([p['warm_ratio']['ratio'] for p in ps])} |"
            )
    return "\n".join(out)
