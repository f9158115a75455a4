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
from shardscale.cli.bench._stats import (
    MIN_VERDICT_SAMPLES,
    NO_DIFFERENCE,
    SMOKE_RUN,
    TOO_FEW,
    median,
    ratio_interval,
)

__all__ = [
    "TEXT_WIDTH",
    "analyse",
    "format_markdown",
    "format_ranges",
    "format_table",
    "is_smoke",
    "params_text",
    "sanitize",
    "write_json",
]

#: The plain-text tables fit a terminal this wide.
TEXT_WIDTH = 120

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
    title = (f"Launches per post-processing step ({', '.join(sorted(kinds))}) and host syncs "
             "(set_sync_debug_mode('error'); clip = unscale + clip alone, post = with step and "
             "update):")  # fmt: skip
    if markdown:
        out = ["", title, "", "| mesh | optimizer | arm | launches | host sync in clip | host sync in post |",
               "| --- | --- | --- | ---: | --- | --- |"]  # fmt: skip
        for row in rows:
            for name, arm in row["arms"].items():
                if "launches_post" in arm:
                    cells = [_mesh(row), row["optimizer"], _LABEL.get(name, name),
                             str(arm["launches_post"]), _sync(arm.get("host_sync_clip")),
                             _sync(arm.get("host_sync_post"))]  # fmt: skip
                    out.append("| " + " | ".join(cells) + " |")
        return out
    out = ["", *_wrap(title)]
    # Host-sync texts (a CUDA error's first line) are cut to fit; the JSON and Markdown keep them.
    table = [(_ARM_HEAD, "launches", "host sync in clip", "host sync in post")]
    for row in rows:
        table.append((_group(row), "", "", ""))
        for name, arm in row["arms"].items():
            if "launches_post" in arm:
                table.append((f"  {_LABEL.get(name, name)}", str(arm["launches_post"]),
                              _cut(_sync(arm.get("host_sync_clip")), 38),
                              _cut(_sync(arm.get("host_sync_post")), 38)))  # fmt: skip
    return out + _columns(table, right=(1,))


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
    if row["mesh"] == shape.replace(" x ", "x"):  # a mesh named in the grammar: its shape says it
        return shape
    return f"{row['mesh']} ({shape})"


def _bytes(arm: dict[str, Any]) -> str:
    text = f"{_mib(arm['grad_bytes_read'])}/{_mib(arm['grad_bytes_written'])}"
    if arm.get("grad_bytes_read_in_backward_hooks"):
        text += f" +{_mib(arm['grad_bytes_read_in_backward_hooks'])} R in hooks"
    return text


def params_text(n: int) -> str:
    """A parameter count people read: ``4.2k``, ``8.4M``, ``1.3B``, or the number itself below 1000."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def is_smoke(result: dict[str, Any]) -> bool:
    """Whether the run's timed rows or scaling table have too few samples for verdicts."""
    rounds = [row["rounds"] for row in result.get("rows", [])]
    sc = result.get("scaling") or {}
    if sc.get("points"):
        rounds.append(sc["warm_repeats"])
    return any(r < MIN_VERDICT_SAMPLES for r in rounds)


def _wrap(text: str, indent: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=TEXT_WIDTH - 2, subsequent_indent=indent) or [""]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _columns(rows: Sequence[tuple[str, ...]], *, right: Sequence[int] = ()) -> list[str]:
    """Aligned text columns, two spaces apart; the first row is the header, underlined.

    A row whose cells after the first are all empty is a group heading, printed as it is.
    """
    body = [r for r in rows if any(r[1:])]
    widths = [max(len(r[i]) for r in body) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        if k and not any(r[1:]):
            out.append(r[0])
            continue
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True))]  # fmt: skip
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("-" * len(out[-1]))
    return out


_ARM_HEAD = "mesh, optimizer / arm"


def _group(row: dict[str, Any]) -> str:
    return f"{_mesh(row)}, {row['optimizer']}"


def _short_verdict(r: dict[str, Any] | None) -> str:
    """The verdict column of the text table: faster, slower, same (no difference), or -."""
    if r is None or r["verdict"] == TOO_FEW:
        return "-"
    return "no diff." if r["verdict"] == NO_DIFFERENCE else str(r["verdict"])


def _heading(result: dict[str, Any]) -> list[str]:
    cfg, env = result["config"], result["environment"]
    row0 = result["rows"][0] if result.get("rows") else None
    machine = (
        f"world size {cfg['world_size']} over {env['collective_library']}, "
        f"{env['device']} ({env['machine']}, {env['cpu_count']} CPUs, load average "
        f"{env.get('load_average_start')} -> {env.get('load_average_end')}), torch {env['torch']}, "
        f"{env['torch_num_threads']} thread(s) per rank"
        + (f", forward under autocast {cfg['amp']}" if cfg.get("amp", "none") != "none" else "")
    )
    smoke = [SMOKE_RUN] if is_smoke(result) else []
    verdicts = (
        f"verdicts need {MIN_VERDICT_SAMPLES} rounds: the intervals are shown, no claim is made"
        if smoke
        else "a ratio is called faster/slower only when its interval excludes 1 (no diff.: it "
        f"includes 1), from {MIN_VERDICT_SAMPLES} rounds up"
    )
    if row0 is None:
        return [
            *smoke,
            *_wrap(
                f"shardscale bench ({result.get('started', '?')}), scaling table only: {machine}"
            ),
            *_wrap(verdicts),
        ]
    return [
        *smoke,
        *_wrap(
            f"shardscale bench ({result.get('started', '?')}): {params_text(cfg['n_params'])}-"
            f"parameter FSDP2 model, {machine}"
        ),
        *_wrap(
            f"{row0['rounds']} measured rounds per arm after {row0['warmup_rounds']} warm-up, "
            "arms in a balanced (Williams) order; step = forward + backward (hooks included) + "
            "post; post = unscale + clip + step + update; the slowest rank per round"
        ),
        *_wrap(
            f"ratio = median(arm) / median(torch) [95 % paired bootstrap interval, "
            f"{cfg['resamples']} resamples, seed {cfg['seed']}]; {verdicts}"
        ),
    ]


def _counts_note(result: dict[str, Any]) -> list[str]:
    row0 = result["rows"][0]
    return _wrap(
        "coll. = collectives per step (ours: counting middleware, torch: CommDebugMode); grad "
        "MiB R/W = gradient memory read/written by post + step, counted per aten op on rank "
        f"{row0.get('counts_from_rank', 0)}; passes = gradient-sized reads + writes of "
        "gradients, parameters and optimizer state, counted the same way; floor = the fewest "
        "for that recipe (docs/benchmark.md), -> its ratio to torch's passes"
    )


def format_table(result: dict[str, Any]) -> str:
    """The main table, the A/A line and the scaling table as plain text within 120 columns."""
    lines = [*_heading(result)]
    if result.get("rows"):
        times = [(_ARM_HEAD, "step ms", "step ratio [95% CI]", "verdict", "post ms",
                  "post ratio [95% CI]", "verdict")]  # fmt: skip
        counts = [(_ARM_HEAD, "coll.", "passes (floor -> ratio)", "grad MiB R/W")]
        for row in result["rows"]:
            times.append((_group(row), "", "", "", "", "", ""))
            counts.append((_group(row), "", "", ""))
            for name, arm in row["arms"].items():
                r = arm.get("ratio")
                label = f"  {_LABEL.get(name, name)}"
                times.append((
                    label, _num(arm["median_ms"]["step"], ".1f"), _ci(r and r["step"]),
                    _short_verdict(r and r["step"]), _num(arm["median_ms"]["post"], ".2f"),
                    _ci(r and r["post"]), _short_verdict(r and r["post"]),
                ))  # fmt: skip
                counts.append((label, str(arm["collectives"]), _passes_cell(arm), _bytes(arm)))
        lines += ["", "Time per step:", *_columns(times, right=(1, 4))]
        lines += ["", "Counts per step:", *_counts_note(result), *_columns(counts, right=(1,))]
        lines += ["", "A/A (torch against itself, the noise floor of this run):"]
        for row in result["rows"]:
            if "aa" in row:
                lines.append(
                    f"  {_group(row)}: step {_ci(row['aa']['step'])}, post {_ci(row['aa']['post'])}"
                )
        vs = [(_ARM_HEAD, "step [95% CI]", "verdict", "backward [95% CI]", "post [95% CI]",
               "verdict")]  # fmt: skip
        for row in result["rows"]:
            if "streaming_vs_ours" in row:
                sv = row["streaming_vs_ours"]
                vs.append((f"  {_group(row)}", _ci(sv["step"]), _short_verdict(sv["step"]),
                           _ci(sv["backward"]), _ci(sv["post"]), _short_verdict(sv["post"])))  # fmt: skip
        if len(vs) > 1:
            lines += ["", "Streaming statistics against plain unscale_and_clip_ (ours + streaming / "
                      "ours):", *_columns(vs)]  # fmt: skip
    lines += _launch_lines(result, markdown=False)
    if result.get("scaling"):
        lines += ["", *_scaling_lines(result["scaling"])]
    return "\n".join(lines)


def _mmm(s: dict[str, Any], unit: float, fmt: str) -> str:
    return "/".join(
        _num(s[k] * unit if s[k] is not None else None, fmt) for k in ("min", "median", "max")
    )


def _scaling_lines(sc: dict[str, Any]) -> list[str]:
    lines = _wrap(
        f"scaling: unscale + clip vs FSDP2 parameters ({sc['param_numel']} elements each), 1-D mesh "
        f"of {sc['mesh_shape'][0]} ranks; cold = first call on a new layout "
        f"({sc['cold_repeats']}+ samples, min/median/max s; cold ratio derived from the "
        f"medians), warm = same layout again ({sc['warm_repeats']} samples, ABBA, ms)"
    )
    table = [("params", "torch cold s", "ours cold s", "cold ratio", "torch warm",
              "ours warm", "warm ratio [95% CI]", "verdict")]  # fmt: skip
    skipped = []
    for p in sc["points"]:
        if "skipped" in p:
            skipped.append(f"{p['n_params']:>7}  skipped: {p['skipped']}")
            continue
        t, o = p["arms"]["torch"], p["arms"]["ours"]
        table.append((
            str(p["n_params"]), _mmm(t["cold"], 1, ".3f"), _mmm(o["cold"], 1, ".3f"),
            _num(p["cold_ratio_derived"], ".3f"), _num(t["warm"]["median"] * 1e3, ".2f"),
            _num(o["warm"]["median"] * 1e3, ".2f"), _ci(p["warm_ratio"]),
            _short_verdict(p["warm_ratio"]),
        ))  # fmt: skip
    if len(table) > 1:
        lines += _columns(table, right=(0, 3, 4, 5))
    return lines + [ln for s in skipped for ln in _wrap(s, indent=" " * 9)]


def format_markdown(result: dict[str, Any]) -> str:
    """The README's tables (main, A/A, scaling) from one run's JSON."""
    env, cfg = result["environment"], result["config"]
    out = [
        f"Run of {result.get('started', '?')}: {params_text(cfg['n_params'])} parameters, world size "
        f"{cfg['world_size']} ({env['collective_library']}), {env['machine']} with {env['cpu_count']} "
        f"CPUs (shared; load average {env.get('load_average_start')} at the start), torch "
        f"{env['torch']}, {env['torch_num_threads']} thread(s) per rank.",
        "",
    ]
    if is_smoke(result):
        out += [f"{SMOKE_RUN} (verdicts need {MIN_VERDICT_SAMPLES} rounds).", ""]
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
