"""``shardscale bench`` refuses bad options with status 2, before creating anything: a value
refused after parsing is one line; a command line that does not parse is bench's own usage
and one error line. Every error line starts ``shardscale bench: error:``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardscale.cli._app import main

# (arguments, a word the one-line message must contain)
BAD: list[tuple[list[str], str]] = [
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--repeats", "0"], "--repeats"),
    (["--repeats", "-1"], "--repeats"),
    (["--cold-repeats", "2"], "--cold-repeats"),
    (["--warmup", "-1"], "--warmup"),
    (["--max-norm", "nan"], "--max-norm"),
    (["--max-norm", "inf"], "--max-norm"),
    (["--max-norm", "0"], "--max-norm"),
    (["--scaling-budget", "nan"], "--scaling-budget"),
    (["--width", "0"], "--width"),
    (["--hidden", "-8"], "--hidden"),
    (["--threads-per-rank", "-1"], "--threads-per-rank"),
    (["--world-size", "0"], "--world-size"),
    (["--meshes", ""], "--meshes"),
    (["--meshes", "dp2,"], "--meshes"),
    (["--mesh", "1x3"], "1x3"),
    (["--meshes", "3d"], "3d"),
    (["--meshes", "2d"], "dp1xtp2"),  # the old spelling, with the new one
    (["--meshes", "pp2"], "tp"),  # the benchmark runs dp and tp meshes only
    (["--meshes", "dp4"], "4 ranks"),
    (["--optimizers", "lamb"], "lamb"),
    (["--optimizers", ""], "--optimizers"),
    (["--backend", "nosuchbackend"], "nosuchbackend"),
    (["--backend", "counting+"], "--backend"),
    (["--scaling-points", "10,x"], "--scaling-points"),
    (["--scaling-points", "0"], "--scaling-points"),
    (["--steps", "many"], "--steps"),
    (["--device", "tpu"], "tpu"),
    (["--amp", "fp8"], "--amp"),
]


@pytest.mark.parametrize(("argv", "word"), BAD, ids=[" ".join(a) or "empty" for a, _ in BAD])
def test_bad_option_is_one_line_and_status_2(
    argv: list[str], word: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    try:
        code = main(["bench", *argv, "--out", str(out)])
    except SystemExit as exc:  # argparse's own checks (a number that is not one)
        code = exc.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.strip().splitlines()
    assert lines[-1].startswith("shardscale bench: error:") and word in lines[-1], captured.err
    # One line, or bench's own usage (never the top-level one) and the line.
    assert len(lines) == 1 or lines[0].startswith("usage: shardscale bench "), captured.err
    assert captured.out == ""
    assert not out.exists()


def test_help_renders_the_percent_sign_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "95 % bootstrap" in text and "%%" not in text
    assert "[host|scale]" in text  # optional: bench alone runs the main benchmark


def test_unwritable_out_is_refused_and_json_takes_no_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for argv in (["--out", str(a_file)], ["--out", str(a_file / "sub")]):
        assert main(["bench", "--quick", *argv]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "--out" in lines[0], lines
        assert not (tmp_path / "o").exists()
    # --json is a flag (JSON on stdout), never a file name.
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--quick", "--out", str(tmp_path / "o"), "--json", str(tmp_path)])
    assert exc.value.code == 2
    assert "shardscale bench: error:" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", ["not json", json.dumps([1, 2]), json.dumps({"schema": 99})])
def test_from_json_refuses_files_that_are_not_results(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["bench", "--from-json", str(bad)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main(["bench", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_missing_plugins_are_named_before_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shardscale.core.plugins import reset_registry

    monkeypatch.setenv("SHARDSCALE_DISABLE_PLUGINS", "fsdp")
    reset_registry()
    try:
        assert main(["bench", "--quick", "--out", str(tmp_path / "o")]) == 2
    finally:
        monkeypatch.delenv("SHARDSCALE_DISABLE_PLUGINS")
        reset_registry()
    assert "shardscale-fsdp" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
