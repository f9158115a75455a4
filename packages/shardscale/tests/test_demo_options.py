"""Every bad ``demo`` / ``train`` option is refused up front: one line, status 2, nothing created.

Each case runs the command in this process with process start-up (``subprocess.Popen``)
and process-group start-up (``init_distributed``) replaced by traps, so a case that
got past the checks fails loudly instead of training.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from shardscale.cli import _distributed
from shardscale.cli._app import main as cli_main
from shardscale.cli.train import main as train_main


@dataclass(frozen=True)
class Bad:
    """One refused command line: ``args`` plus what the message must contain."""

    id: str
    args: tuple[str, ...]
    option: str  # the option the message must name
    fix: str  # a piece of the suggested fix
    commands: tuple[str, ...] = ("demo", "train")


CASES: list[Bad] = [
    Bad("lr-negative", ("--lr", "-1"), "--lr", "--lr 0.003"),
    Bad("lr-nan", ("--lr", "nan"), "--lr", "--lr 0.003"),
    Bad("lr-inf", ("--lr", "inf"), "--lr", "--lr 0.003"),
    Bad("lr-zero", ("--lr", "0"), "--lr", "--lr 0.003"),
    Bad("init-scale-zero", ("--init-scale", "0"), "--init-scale", "--init-scale 65536"),
    Bad("init-scale-negative", ("--init-scale", "-4"), "--init-scale", "--init-scale 65536"),
    Bad("init-scale-nan", ("--init-scale", "nan"), "--init-scale", "--init-scale 65536"),
    Bad("init-scale-inf", ("--init-scale", "inf"), "--init-scale", "--init-scale 65536"),
    Bad("max-norm-zero", ("--max-norm", "0"), "--max-norm", "--max-norm 1.0"),
    Bad("max-norm-negative", ("--max-norm", "-1"), "--max-norm", "--max-norm 1.0"),
    Bad("max-norm-nan", ("--max-norm", "nan"), "--max-norm", "--max-norm 1.0"),
    Bad("steps-zero", ("--steps", "0"), "--steps", "--steps 100"),
    Bad("steps-negative", ("--steps", "-3"), "--steps", "--steps 100"),
    Bad("batch-zero", ("--batch-size", "0"), "--batch-size", "--batch-size 8"),
    Bad("context-zero", ("--context", "0"), "--context", "--context 64"),
    Bad("context-beyond-corpus", ("--context", "100000"), "--context", "at most"),
    Bad("width-zero", ("--d-model", "0"), "--d-model", "--d-model 64"),
    Bad("width-negative", ("--d-model", "-64"), "--d-model", "--d-model 64"),
    Bad("width-not-divisible", ("--d-model", "63", "--heads", "2"), "--d-model", "--d-model 62"),
    Bad("layers-zero", ("--layers", "0"), "--layers", "--layers 2"),
    Bad("heads-zero", ("--heads", "0"), "--heads", "--heads 2"),
    Bad(
        "growth-interval-zero",
        ("--growth-interval", "0"),
        "--growth-interval",
        "--growth-interval 10",
    ),
    Bad("sample-chars-negative", ("--sample-chars", "-1"), "--sample-chars", "--sample-chars 0"),
    Bad("mesh-empty", ("--mesh", ""), "--mesh", "'2x2'"),
    Bad("mesh-garbage", ("--mesh", "3x"), "--mesh", "'dp2xtp2'"),
    Bad(
        "mesh-1x3-for-2-ranks",
        ("--mesh", "1x3", "--world-size", "2"),
        "--mesh",
        "--world-size 3",
        ("demo",),
    ),
    Bad("mesh-1x3-for-1-rank", ("--mesh", "1x3"), "--mesh", "--world-size 3", ("train",)),
    Bad(
        "mesh-tp-splits-heads", ("--mesh", "1x2", "--heads", "1"), "--mesh", "--heads 2", ("demo",)
    ),
    Bad("mesh-pp-garbage", ("--mesh", "pp"), "--mesh", "'pp2xdp2'"),
    Bad("mesh-pp-twice", ("--mesh", "pp2xpp2"), "--mesh", "written twice"),
    Bad("mesh-old-comma-syntax", ("--mesh", "pp2,dp2"), "--mesh", "'pp2xdp2'"),
    Bad("mesh-dp-outside-pp", ("--mesh", "dp2xpp2"), "--mesh", "'pp2xdp2'"),
    Bad("mesh-expert-dim", ("--mesh", "ep2"), "--mesh", "'dp2xtp2'"),
    Bad(
        "mesh-pp-more-stages-than-blocks",
        ("--mesh", "pp4", "--layers", "2"),
        "--mesh",
        "--layers 4",
        ("demo",),
    ),
    Bad(
        "mesh-pp-batch-uneven",
        ("--mesh", "pp2", "--batch-size", "3"),
        "--mesh",
        "--batch-size 2",
        ("demo",),
    ),
    Bad("inject-spike-negative", ("--inject-spike", "-1"), "--inject-spike", "--inject-spike 150"),
    Bad(
        "inject-spike-past-the-end",
        ("--steps", "10", "--inject-spike", "11"),
        "--inject-spike",
        "--inject-spike 7",
    ),
    Bad(
        "inject-spike-with-pipeline-stages",
        ("--mesh", "pp2", "--inject-spike", "5"),
        "--inject-spike",
        "a mesh without pp",
        ("demo",),
    ),
    Bad(
        "init-scale-with-bf16",
        ("--precision", "bf16", "--init-scale", "1024"),
        "--init-scale",
        "--precision fp16",
    ),
    Bad(
        "growth-interval-with-bf16",
        ("--precision", "bf16", "--growth-interval", "5"),
        "--growth-interval",
        "leave --growth-interval out",
    ),
    Bad(
        "max-consecutive-skips-negative",
        ("--max-consecutive-skips", "-2"),
        "--max-consecutive-skips",
        "--max-consecutive-skips 10",
    ),
    Bad("backend-unknown", ("--backend", "carrier-pigeon"), "--backend", "shardscale plugins"),
    Bad("backend-only-middleware", ("--backend", "counting"), "--backend", "shardscale plugins"),
    Bad("backend-empty", ("--backend", ""), "--backend", "--backend c10d"),
    Bad("backend-local-multi", ("--backend", "local"), "--backend", "use c10d", ("demo",)),
    Bad("world-size-zero", ("--world-size", "0"), "--world-size", "--world-size 2", ("demo",)),
    Bad("world-size-negative", ("--world-size", "-2"), "--world-size", "--world-size 2", ("demo",)),
    Bad("timeout-nan", ("--timeout", "nan"), "--timeout", "--timeout 300", ("demo",)),
    Bad("timeout-negative", ("--timeout", "-5"), "--timeout", "--timeout 300", ("demo",)),
    Bad("timeout-zero", ("--timeout", "0"), "--timeout", "--timeout 300", ("demo",)),
    Bad("timeout-inf", ("--timeout", "inf"), "--timeout", "--timeout 300", ("demo",)),
]


class _Started(AssertionError):
    """Raised by the traps: the command got past its checks."""


@pytest.fixture
def traps(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise _Started(f"a process was started: {args!r}")

    def no_group(**kwargs: object) -> None:
        raise _Started("init_distributed was called")

    import subprocess

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(_distributed, "init_distributed", no_group)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SHARDSCALE_BACKEND"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)


def _run(command: str, args: Sequence[str]) -> tuple[int, str, str]:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = cli_main(["demo", *args]) if command == "demo" else train_main(list(args))
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def _params() -> list[object]:
    return [
        pytest.param(command, case, id=f"{command}-{case.id}")
        for case in CASES
        for command in case.commands
    ]


@pytest.mark.usefixtures("traps")
@pytest.mark.parametrize(("command", "case"), _params())
def test_bad_option_is_one_line_status_2_and_nothing_created(
    command: str, case: Bad, tmp_path: Path
) -> None:
    out = tmp_path / "never"
    code, stdout, stderr = _run(command, [*case.args, "--device", "cpu", "--out", str(out)])
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{stderr}"
    prefix = "shardscale demo" if command == "demo" else "python -m shardscale.cli.train"
    assert lines[0].startswith(f"{prefix}: error: "), lines[0]
    assert case.option in lines[0], lines[0]
    assert case.fix in lines[0], lines[0]
    assert not out.exists(), f"{out} was created before refusing"


@pytest.mark.usefixtures("traps")
@pytest.mark.parametrize("command", ["demo", "train"])
@pytest.mark.parametrize("where", ["under-a-file", "is-a-file"])
def test_unwritable_out_is_one_line_status_2(command: str, where: str, tmp_path: Path) -> None:
    # Root may write anywhere, so "unwritable" here is a path a folder cannot exist at.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "out" if where == "under-a-file" else blocker
    code, stdout, stderr = _run(command, ["--device", "cpu", "--out", str(out)])
    assert code == 2, stdout + stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "is a file" in lines[0], stderr
    assert blocker.read_text() == "not a folder"


@pytest.mark.usefixtures("traps")
def test_read_only_out_is_refused(tmp_path: Path) -> None:
    import os

    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("this user writes through read-only permissions (root)")
        code, _, stderr = _run("demo", ["--device", "cpu", "--out", str(parent / "out")])
        assert code == 2 and "not writable" in stderr and len(stderr.strip().splitlines()) == 1
    finally:
        parent.chmod(0o700)


@pytest.mark.usefixtures("traps")
def test_max_norm_inf_is_valid_and_reaches_the_launch(tmp_path: Path) -> None:
    # inf means "measure the norm, never clip": the checks pass and the demo tries to start.
    out = tmp_path / "inf"
    with pytest.raises(_Started):
        _run("demo", ["--max-norm", "inf", "--device", "cpu", "--out", str(out)])
    with pytest.raises(_Started):
        _run("train", ["--max-norm", "inf", "--device", "cpu", "--out", str(out)])


def test_sizes_depend_on_the_device() -> None:
    import argparse

    from shardscale.cli.train import add_training_options, config_from_args

    parser = argparse.ArgumentParser()
    add_training_options(parser)
    cpu = config_from_args(parser.parse_args([]), device="cpu")
    cuda = config_from_args(parser.parse_args([]), device="cuda")
    assert cpu.precision == cuda.precision == "fp16"
    # The CPU demo is the small one (fp16 matmuls are slow there); both are real transformers.
    assert cpu.d_model * cpu.n_layers < cuda.d_model * cuda.n_layers
    assert cpu.n_layers >= 2 and cpu.n_heads >= 2 and cpu.context >= 32
    explicit = config_from_args(
        parser.parse_args(["--d-model", "32", "--steps", "7"]), device="cuda"
    )
    assert (explicit.d_model, explicit.steps, explicit.n_layers) == (32, 7, cuda.n_layers)
    assert math.isinf(config_from_args(parser.parse_args(["--max-norm", "inf"])).max_norm)


@pytest.mark.parametrize(
    ("spec", "shape"),
    [("4", (4, 1, 1)), ("2x2", (2, 2, 1)), ("pp2", (1, 1, 2)), ("pp2xdp2", (2, 1, 2)),
     ("dp2xtp2", (2, 2, 1)), ("dp3", (3, 1, 1)), (" PP4 ", (1, 1, 4))],
)  # fmt: skip
def test_mesh_shapes_parse(spec: str, shape: tuple[int, int, int]) -> None:
    from shardscale.cli._distributed import mesh_shape

    got = mesh_shape(spec)
    assert (got.dp, got.tp, got.pp) == shape
    assert got.size == shape[0] * shape[1] * shape[2]
    assert mesh_shape(str(got)) == got  # the demo's own spelling parses back
