"""``shardscale doctor`` tells the truth about this machine and exits non-zero when broken."""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

import torch

from shardscale.cli._app import main
from shardscale.cli._doctor import run_checks


def _findings(stdout: str) -> list[dict[str, str]]:
    data = json.loads(stdout)
    assert data["ok"] is not any(f["status"] == "error" for f in data["findings"])
    return list(data["findings"])


def test_healthy_machine_exits_0_and_reports_torch_and_cuda(run_cli) -> None:
    proc = run_cli(["doctor", "--json"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    findings = _findings(proc.stdout)
    torch_f = next(f for f in findings if f["check"] == "torch")
    assert torch_f["status"] == "ok" and torch.__version__ in torch_f["detail"]
    cuda_f = next(f for f in findings if f["check"] == "cuda")
    if torch.cuda.is_available():
        assert cuda_f["status"] == "ok"
        assert str(torch.cuda.device_count()) in cuda_f["detail"]
    else:
        assert cuda_f["status"] in ("info", "warn")
        assert "GPU" in cuda_f["detail"] or "CUDA" in cuda_f["detail"]
    launch = next(f for f in findings if f["check"] == "launch")
    assert "not launched by torchrun" in launch["detail"]
    triton = [f for f in findings if f["check"] == "triton"]
    try:
        installed = md.version("triton")
    except md.PackageNotFoundError:
        assert triton == []
    else:
        # The test sessions install the Triton torch pins (or, beside a CPU torch, any >= 3.6).
        assert [f["status"] for f in triton] == ["ok"], triton
        assert f"triton {installed}" in triton[0]["detail"]
        pins = [r for r in md.requires("torch") or [] if r.startswith("triton")]
        assert ("torch requires" in triton[0]["detail"]) is bool(pins), (pins, triton)


def test_text_output_says_nothing_is_broken(run_cli) -> None:
    proc = run_cli(["doctor"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing is broken" in proc.stdout
    assert "[ok] torch" in proc.stdout  # rich markup must not swallow the status marks


def test_half_set_launch_environment_is_an_error(run_cli) -> None:
    proc = run_cli(["doctor", "--json"], env={"RANK": "0", "WORLD_SIZE": "2"})
    assert proc.returncode == 1
    launch = next(f for f in _findings(proc.stdout) if f["check"] == "launch")
    assert launch["status"] == "error"
    assert "MASTER_ADDR" in launch["detail"] and launch["fix"]


def test_rank_outside_world_is_an_error(run_cli) -> None:
    env = {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    proc = run_cli(["doctor", "--json"], env=env)
    assert proc.returncode == 1
    launch = next(f for f in _findings(proc.stdout) if f["check"] == "launch")
    assert "RANK=3" in launch["detail"]


def test_plugin_that_fails_to_load_is_an_error_with_a_fix(run_cli, tmp_path: Path) -> None:
    info = tmp_path / "shardscale_broken_doc-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: shardscale-broken-doc\nVersion: 0.0.1\n"
    )
    (info / "entry_points.txt").write_text("[shardscale]\nbroken_doc = shardscale_no_such_module\n")
    proc = run_cli(["doctor"], env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1
    assert "broken_doc" in proc.stdout and "SHARDSCALE_DISABLE_PLUGINS=broken_doc" in proc.stdout
    assert "something is broken" in proc.stdout


def test_unknown_backend_spec_is_an_error(capsys) -> None:
    assert main(["doctor", "--json", "--backend", "no-such-backend"]) == 1
    findings = _findings(capsys.readouterr().out)
    bad = next(f for f in findings if f["check"] == "backend")
    assert bad["status"] == "error" and "no-such-backend" in bad["detail"]
    assert "local" in bad["detail"]  # the error lists what is installed


def test_connect_without_torchrun_is_a_warning_not_a_hang() -> None:
    findings = run_checks(connect=True)
    pg = next(f for f in findings if f.check == "process group")
    assert pg.status == "warn" and "torchrun" in pg.fix


def test_the_backend_from_the_environment_is_built_and_checked(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SHARDSCALE_BACKEND", "bogus")
    assert main(["doctor", "--json"]) == 1
    bad = next(f for f in _findings(capsys.readouterr().out) if f["check"] == "backend")
    assert bad["status"] == "error" and "'bogus' from $SHARDSCALE_BACKEND" in bad["detail"]
    assert "local" in bad["detail"] and bad["fix"]


def test_a_healthy_machine_really_steps_a_scaler(capsys, monkeypatch) -> None:
    monkeypatch.delenv("SHARDSCALE_BACKEND", raising=False)
    assert main(["doctor", "--json"]) == 0
    findings = {f["check"]: f for f in _findings(capsys.readouterr().out)}
    assert findings["scaler step"]["status"] == "ok"
    assert "local" in findings["backend"]["detail"]
    assert findings["adapters"]["detail"].rstrip(")").endswith("shardscale-core")  # plain is last
    assert findings["kernels (cpu)"]["status"] == "ok"


def test_a_bad_telemetry_setting_is_a_finding_with_its_own_fix(run_cli) -> None:
    # doctor's scaler step reaches the telemetry observer, which rejects the variable; the
    # finding carries the telemetry fix, not "reinstall the plugin".
    proc = run_cli(["doctor", "--json"], env={"SHARDSCALE_TELEMETRY": "jsonl:a.jsonl,every=-1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    bad = [f for f in _findings(proc.stdout) if f["status"] == "error"]
    assert any("every='-1'" in f["detail"] for f in bad), bad
    assert any("correct SHARDSCALE_TELEMETRY" in f["fix"] for f in bad), bad
