"""``shardscale plugins``: the listing tells the truth about what is registered and usable."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import ClassVar

from shardscale.cli._app import main
from shardscale.cli._plugins_cmd import collect_plugins
from shardscale.core import get_registry, hookimpl
from shardscale.core.plugins import reset_registry


def _by_name(items: list[dict[str, object]], kind: str, name: str) -> dict[str, object]:
    found = [it for it in items if it["kind"] == kind and it["name"] == name]
    assert len(found) == 1, f"{kind} {name!r} listed {len(found)} times: {items}"
    return found[0]


def test_json_lists_core_builtins_in_a_subprocess(run_cli) -> None:
    proc = run_cli(["plugins", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for kind, name in (("backend", "local"), ("adapter", "plain"), ("kernels", "foreach")):
        item = _by_name(data["items"], kind, name)
        assert item["distribution"] == "shardscale-core"
        assert item["usable"] is True and item["reason"] is None
    from importlib.metadata import version

    assert _by_name(data["items"], "backend", "local")["version"] == version("shardscale-core")
    assert any(p["name"] == "core" for p in data["plugins"])


def test_table_output_names_every_item(run_cli) -> None:
    proc = run_cli(["plugins"])
    assert proc.returncode == 0, proc.stderr
    for item in get_registry().items():
        assert item.name in proc.stdout


def test_blocked_plugin_is_reported_not_listed(run_cli) -> None:
    proc = run_cli(["plugins", "--json"], env={"SHARDSCALE_DISABLE_PLUGINS": "core"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert not any(it["distribution"] == "shardscale-core" for it in data["items"])
    blocked = [f for f in data["failures"] if f["name"] == "core"]
    assert blocked and blocked[0]["blocked"] is True
    # What the block leaves is said, kind by kind: core's local, plain and foreach are gone.
    assert data["disable"]["blocked"] == ["core"]
    remaining = data["disable"]["remaining"]
    assert "local" not in remaining["backend"] and "plain" not in remaining["adapter"]
    assert "foreach" not in remaining["kernels"]


def test_plugin_that_fails_to_import_makes_exit_status_1(run_cli, tmp_path: Path) -> None:
    # A real installed distribution (dist-info on sys.path) whose plugin module is missing.
    info = tmp_path / "shardscale_broken_demo-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: shardscale-broken-demo\nVersion: 0.0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[shardscale]\nbroken_demo = shardscale_broken_demo_missing._plugin\n"
    )
    proc = run_cli(["plugins", "--json"], env={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    failure = next(f for f in data["failures"] if f["name"] == "broken_demo")
    assert failure["distribution"] == "shardscale-broken-demo"
    assert "ModuleNotFoundError" in failure["error"] and failure["blocked"] is False
    # The others still load.
    assert _by_name(data["items"], "backend", "local")["usable"] is True


class _NeedsHardware:
    name: ClassVar[str] = "needs-hardware-demo"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return "needs hardware this machine lacks"


class _DemoPlugin:
    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        return [_NeedsHardware]


def test_in_process_plugin_shows_usability_and_reason(capsys) -> None:
    reset_registry()
    reg = get_registry()
    name = reg.register(_DemoPlugin(), name="cli-test-plugin")
    try:
        assert main(["plugins", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        item = _by_name(data["items"], "backend", "needs-hardware-demo")
        assert item["usable"] is False
        assert item["reason"] == "needs hardware this machine lacks"
        assert item["distribution"] == "<in-process>"
        assert main(["plugins"]) == 0
        text = capsys.readouterr().out
        assert "needs-hardware-demo" in text and "no: needs hardware this machine lacks" in text
    finally:
        reg.unregister(name)
        reset_registry()
    assert not any(it["name"] == "needs-hardware-demo" for it in collect_plugins()["items"])


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "shardscale"
    assert script.exists() or shutil.which("shardscale"), "the shardscale console script is missing"


def test_plain_table_without_rich() -> None:
    from shardscale.cli._ui import print_table

    out = io.StringIO()
    print_table("t", [("local", "backend"), ("plain", "adapter")], headers=("name", "kind"),
                stream=out, use_rich=False)  # fmt: skip
    lines = out.getvalue().splitlines()
    assert lines[0] == "t" and lines[1].split() == ["name", "kind"]
    assert lines[2].split() == ["local", "backend"]


def test_rich_table_keeps_brackets_and_long_names() -> None:
    from shardscale.cli._ui import have_rich, print_table

    if not have_rich():
        import pytest

        pytest.skip("rich is not installed (the ui extra)")
    out = io.StringIO()
    long_name = "a-rather-long-plugin-name-that-must-not-be-cut"
    print_table("t", [("[ok] torch", long_name)], headers=("check", "x"), stream=out,
                use_rich=True)  # fmt: skip
    text = out.getvalue()
    assert "[ok] torch" in text
    assert "…" not in text
    assert "".join(text.split()).count("".join(long_name.split())) or all(
        part in text for part in long_name.split("-")
    )
