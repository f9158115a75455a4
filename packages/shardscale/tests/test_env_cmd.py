"""``shardscale env`` (issue 28, item 5): the environment to paste into an issue, and doctor's output."""

from __future__ import annotations

import json
import platform
from importlib import metadata

import torch

from shardscale.cli._env import collect_environment, format_environment


def _installed_shardscale() -> dict[str, str]:
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "shardscale" or name.startswith("shardscale-"):
            found[name] = dist.version
    return found


def test_env_json_names_what_an_issue_needs(run_cli) -> None:
    proc = run_cli(["env", "--json"])
    assert proc.returncode == 0, proc.stderr
    env = json.loads(proc.stdout)
    # Every installed shardscale distribution, with the version pip sees.
    assert {d["name"]: d["version"] for d in env["shardscale"]} == _installed_shardscale()
    assert env["python"]["version"] == platform.python_version()
    assert env["torch"]["version"] == torch.__version__
    assert env["torch"]["cuda_build"] == torch.version.cuda
    assert env["torch"]["cuda_available"] == torch.cuda.is_available()
    assert len(env["torch"]["gpus"]) == (
        torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    assert env["torch"]["gloo"] is True  # every supported torch build has gloo
    for name in ("accelerate", "transformers", "lightning", "triton"):
        try:
            expected: str | None = metadata.version(name)
        except metadata.PackageNotFoundError:
            expected = None
        assert env["frameworks"].get(name) == expected, name
    loaded = {p["name"]: p["distribution"] for p in env["plugins"]["loaded"]}
    assert loaded["core"] == "shardscale-core"


def test_env_text_is_one_block_with_every_distribution(run_cli) -> None:
    proc = run_cli(["env"], env={"SHARDSCALE_BACKEND": "c10d"})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for name, version in _installed_shardscale().items():
        assert f"- {name}: {version}" in text
    assert f"- torch: {torch.__version__}" in text
    assert f"- Python: {platform.python_version()}" in text
    assert "SHARDSCALE_BACKEND=c10d" in text
    assert "\x1b[" not in text  # piped: no colour codes


def test_format_lists_failed_plugins() -> None:
    env = collect_environment()
    env["plugins"]["failed"] = [
        {"name": "x", "distribution": "x-dist", "version": "1", "blocked": False, "error": "boom"}
    ]
    assert "- plugin x (x-dist): FAILED: boom" in format_environment(env)


def test_doctor_piped_is_unpadded_and_uncoloured(run_cli) -> None:
    proc = run_cli(["doctor"])
    lines = proc.stdout.splitlines()
    assert any(line.startswith("[ok] torch") for line in lines), proc.stdout
    # Lines used to be padded to the longest finding (212 columns).
    assert all(line == line.rstrip() for line in lines), [x for x in lines if x != x.rstrip()]
    assert "\x1b[" not in proc.stdout


def test_doctor_colours_statuses_on_a_terminal() -> None:
    import io

    from shardscale.cli._ui import print_table

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    print_table("t", [("[ok] a", "fine"), ("[XX] b", "broken")], headers=("check", "finding"),
                stream=out, use_rich=False, styles=["green", "red"])  # fmt: skip
    assert "\x1b[32m[ok] a" in out.getvalue() and "\x1b[31m[XX] b" in out.getvalue()
