"""tools/gpu_check.py on a machine without a GPU: its two commands (``tests``, ``bench``) run,
say why each CUDA part is skipped, write one report and exit 0; with nothing to install from,
install fails before touching pip. Each command's parts fit the 5 minutes a command may take
on the GPU lease."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
TESTS_CUDA = ["cuda tests", "triton tests"]
BENCH_CUDA = ["bench (8.4M)", "bench (33.6M)"]


def _run(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    # A shared CPU runs this: the limits are the GPU machine's, scaled (torch alone can take 30 s
    # to import at a load of 12 on 2 cores).
    state = ["--state", str(tmp / "parts.json"), "--site", str(tmp / "site"), "--time-scale", "5"]
    return subprocess.run([sys.executable, str(SCRIPT), *args, *state], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip


def _tool() -> dict[str, object]:
    import runpy

    return runpy.run_path(str(SCRIPT))


def test_each_command_runs_its_parts_in_order_within_five_minutes() -> None:
    tool = _tool()
    commands, limits = tool["COMMANDS"], tool["LIMITS"]
    assert commands == {  # in order of value: what a short lease must not miss comes first
        "tests": ["environment", "install", "doctor", "cuda tests", "triton tests"],
        "bench": ["environment", "install", "bench (8.4M)", "bench (33.6M)"],
    }
    budget = tool["BUDGET_S"]
    assert budget <= 300  # a command may take 5 minutes on the lease (10 at most)
    for parts in commands.values():  # type: ignore[attr-defined]
        # Every part gets its whole limit within the budget (the first parts are quick).
        assert sum(limits[p] for p in parts) <= budget, parts  # type: ignore[index]


@pytest.mark.timeout(300)
def test_without_cuda_every_cuda_part_is_skipped_with_a_reason_and_one_report_has_both(
    tmp_path: Path,
) -> None:
    report = tmp_path / "report.md"
    proc = _run("tests", "--no-install", "--report", str(report), tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "[ok  ] environment" in out and "[ok  ] doctor" in out, out
    assert "skipped install: --no-install" in out, out
    for part in TESTS_CUDA:
        line = next((ln for ln in out.splitlines() if ln.startswith(f"  skipped {part}:")), None)
        assert line is not None, (part, out)
        assert "no CUDA device (torch.cuda.is_available() is False" in line, line
    assert "2 parts ok, 0 failed, 3 skipped" in out, out
    first = report.read_text(encoding="utf-8")
    assert "| tests | doctor |" in first and "| bench |" not in first
    proc = _run("bench", "--no-install", "--report", str(report), tmp=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for part in BENCH_CUDA:
        assert f"  skipped {part}: no CUDA device" in proc.stdout, (part, proc.stdout)
    assert "1 parts ok, 0 failed, 3 skipped" in proc.stdout, proc.stdout
    text = report.read_text(encoding="utf-8")
    import torch

    assert f"torch {torch.__version__}" in text
    # The second command's report holds the first command's parts too, tests first.
    for command, part in [("tests", "environment"), ("tests", "install"), ("tests", "doctor"),
                          *[("tests", p) for p in TESTS_CUDA], ("bench", "environment"),
                          ("bench", "install"), *[("bench", p) for p in BENCH_CUDA]]:  # fmt: skip
        assert f"| {command} | {part} |" in text, (command, part)
    assert text.index("| tests | doctor |") < text.index("| bench | environment |")
    assert "nothing is broken" in text  # doctor really ran, in this Python


@pytest.mark.timeout(120)
def test_an_empty_wheelhouse_fails_install_and_runs_nothing_after(tmp_path: Path) -> None:
    (tmp_path / "house").mkdir()
    proc = _run("tests", "--wheelhouse", str(tmp_path / "house"), "--report",
                str(tmp_path / "r.md"), tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED install: no shardscale-core wheel in" in proc.stdout, proc.stdout
    assert "nox -s gpu_wheelhouse" in proc.stdout
    for part in ["doctor", *TESTS_CUDA]:
        assert f"skipped {part}: not run: install failed" in proc.stdout, (part, proc.stdout)


@pytest.mark.timeout(120)
def test_only_runs_the_parts_named_and_says_why_the_others_did_not_run(tmp_path: Path) -> None:
    proc = _run("tests", "--only", "environment", "--report", str(tmp_path / "r.md"),
                tmp=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok  ] environment" in proc.stdout, proc.stdout
    for part in ["install", "doctor", *TESTS_CUDA]:
        assert f"skipped {part}: not in --only" in proc.stdout, (part, proc.stdout)
    assert "1 parts ok, 0 failed, 4 skipped" in proc.stdout, proc.stdout


def test_a_budget_beyond_reason_is_refused(tmp_path: Path) -> None:
    proc = _run("tests", "--budget", "0", tmp=tmp_path)
    assert proc.returncode == 2 and "--budget" in proc.stderr


def test_bench_parts_run_the_memory_tables_two_models_on_every_gpu_up_to_two() -> None:
    import argparse
    import runpy

    tool = runpy.run_path(str(SCRIPT))
    args = argparse.Namespace(python="py", budget=60.0, quick_bench=False, no_install=False,
                              site="site")  # fmt: skip
    run = tool["Run"](args)
    for gpus, world, meshes in ((["H100"], "1", "dp1"), (["H100"] * 8, "2", "dp2,dp1xtp2")):
        run.env = {"gpus": gpus}
        small = tool["bench_argv"](run, "bench (8.4M)", Path("out"))
        large = tool["bench_argv"](run, "bench (33.6M)", Path("out"))
        for argv in (small, large):
            assert argv[argv.index("--device") + 1] == "cuda"
            assert argv[argv.index("--world-size") + 1] == world
            assert argv[argv.index("--meshes") + 1] == meshes
            assert argv[argv.index("--amp") + 1] == "fp16"  # the fp16 recipe the scaler is for
            assert "--quick" not in argv
        # 4 blocks of width w and hidden h: 4 * (2wh + w + h) parameters.
        for argv, params in ((small, 8.4e6), (large, 33.6e6)):
            w, h = int(argv[argv.index("--width") + 1]), int(argv[argv.index("--hidden") + 1])
            assert abs(4 * (2 * w * h + w + h) - params) < 0.05e6
    run.args.quick_bench = True
    assert "--quick" in tool["bench_argv"](run, "bench (8.4M)", Path("out"))


def _nox_functions() -> dict[str, object]:
    """The noxfile's functions, by name, read with ``ast`` (nox itself need not be installed)."""
    import ast

    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_bench_session_finds_the_device_argument_in_either_spelling() -> None:
    import ast

    node = _nox_functions()["_device_arg"]
    module = ast.Module(body=[node], type_ignores=[])  # type: ignore[list-item]
    scope: dict[str, object] = {}
    exec(compile(module, "noxfile.py", "exec"), scope)
    device_arg = scope["_device_arg"]
    assert device_arg(["--quick", "--device", "cuda"]) == "cuda"  # type: ignore[operator]
    assert device_arg(["--device=cuda", "--quick"]) == "cuda"  # type: ignore[operator]
    assert device_arg(["--device", "cpu"]) == "cpu"  # type: ignore[operator]
    assert device_arg(["--quick"]) is None  # type: ignore[operator]
    assert device_arg(["--device"]) is None  # type: ignore[operator]


def test_bench_on_cuda_installs_nothing_into_a_venv_and_runs_the_machines_python() -> None:
    import ast

    funcs = _nox_functions()
    gpu_path = funcs["_bench_with_machine_torch"]
    calls = [n for n in ast.walk(gpu_path) if isinstance(n, ast.Call)]  # type: ignore[arg-type]
    names = [ast.unparse(c.func) for c in calls]
    assert "session.install" not in names and "_install_torch" not in names
    runs = [c for c in calls if ast.unparse(c.func) == "session.run"]
    assert len(runs) == 2
    for run in runs:  # both with the machine's Python, outside the session's virtualenv
        assert any(k.arg == "external" and ast.unparse(k.value) == "True" for k in run.keywords)
        assert ast.unparse(run.args[0]) == "python"
    # The bench session takes that path for --device cuda before installing anything.
    bench = ast.unparse(funcs["bench"])  # type: ignore[arg-type]
    assert bench.index("_bench_with_machine_torch") < bench.index("_install_torch")


def test_the_dry_run_session_installs_torch_alone_and_runs_both_commands() -> None:
    import ast

    node = _nox_functions()["gpu_dry_run"]
    text = ast.unparse(node)  # type: ignore[arg-type]
    calls = [ast.unparse(c.func) for c in ast.walk(node) if isinstance(c, ast.Call)]  # type: ignore[arg-type]
    # Only torch goes in by hand: ours and the test dependencies come from the wheelhouse
    # (pip --no-index, inside gpu_check's install part), and hatchling is refused.
    assert "session.install" not in calls and "_install_torch" in calls
    assert "hatchling is installed" in text  # the session refuses a venv that has it
    assert text.index("'tests'") < text.index("'bench'")
    tool = _tool()
    install = ast.unparse(
        next(
            n
            for n in ast.parse(SCRIPT.read_text()).body
            if isinstance(n, ast.FunctionDef) and n.name == "install"
        )
    )
    assert "--no-index" in install and "--target" in install and "--no-deps" in install
    assert tool["SITE"] == ROOT / ".nox" / "gpu-site"
