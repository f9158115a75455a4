"""The clipping benchmark runs end to end and reports the counts it should (never wall time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardscale.clip._bench import format_table, main, run_benchmark

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def test_tiny_benchmark_counts_collectives_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = run_benchmark(
        world_size=2,
        width=32,
        hidden=64,
        blocks=2,
        batch=4,
        steps=1,
        warmup=0,
        repeats=2,
        json_path=out,
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = {(r["mesh"], r["optimizer"]): r for r in result["rows"]}
    assert set(rows) == {(m, o) for m in ("1d", "2d") for o in ("sgd", "adam_fused")}
    for (_mesh, opt), row in rows.items():
        recipes = row["recipes"]
        assert set(recipes) == {"torch", "ours", "ours_streaming"}
        # One collective carries norm and overflow; torch needs at least two.
        assert recipes["ours"]["collectives"] == recipes["ours_streaming"]["collectives"] == 1
        assert recipes["torch"]["collectives"] >= 2
        grad = row["local_grad_bytes"]
        assert grad > 0
        assert (recipes["torch"]["grad_bytes_read"], recipes["torch"]["grad_bytes_written"]) == (
            3 * grad,
            2 * grad,
        )
        ours = recipes["ours"]
        if opt == "adam_fused":  # one read, nothing written: the optimizer divides by grad_scale
            assert (ours["grad_bytes_read"], ours["grad_bytes_written"]) == (grad, 0)
        else:  # one read, then one multiply
            assert (ours["grad_bytes_read"], ours["grad_bytes_written"]) == (2 * grad, grad)
        for rec in recipes.values():
            assert rec["post_ms"] > 0 and rec["step_ms"] > 0 and rec["host_syncs"] is None
    table = format_table(result)
    assert table.count("\n") >= 4 + 3 * len(rows)
    assert "ours_streaming" in table


def test_cli_rejects_bad_arguments_before_starting_processes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even world_size"):
        main(["--world-size", "3", "--json", str(tmp_path / "x.json")])
    with pytest.raises(ValueError, match="unknown optimizer"):
        main(["--optimizers", "lamb", "--json", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_missing_plugins_are_named_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardscale.core import reset_registry

    monkeypatch.setenv("SHARDSCALE_DISABLE_PLUGINS", "fsdp")
    reset_registry()
    try:
        with pytest.raises(ValueError, match=r"needs shardscale-fsdp: pip install"):
            run_benchmark(json_path=tmp_path / "x.json")
    finally:
        monkeypatch.delenv("SHARDSCALE_DISABLE_PLUGINS")
        reset_registry()
    assert not (tmp_path / "x.json").exists()
