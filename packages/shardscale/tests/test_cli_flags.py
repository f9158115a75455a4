"""One meaning per flag across ``demo``, ``plugins``, ``doctor`` and ``env`` (issue 28, item 3).

Every command refuses an unknown option with its own usage and ``shardscale <cmd>: error:``,
exit status 2; ``--json`` is JSON on stdout; ``--plugin-timeout`` names its range.
"""

from __future__ import annotations

import json

import pytest

from shardscale.cli._app import main

COMMANDS = ["demo", "plugins", "doctor", "env"]


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_option_is_the_subcommands_error(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--no-such-option"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: shardscale {command} "), err
    assert f"shardscale {command}: error: unrecognized arguments: --no-such-option" in err


@pytest.mark.parametrize("command", ["plugins", "doctor", "env"])
@pytest.mark.parametrize("value", ["1e10", "0", "-1", "nan", "inf", "soon"])
def test_plugin_timeout_outside_its_range_is_refused(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1e10 used to be accepted, and then every plugin (core's too) was reported broken with
    # an OverflowError from the thread join.
    with pytest.raises(SystemExit) as info:
        main([command, "--plugin-timeout", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"shardscale {command}: error: argument --plugin-timeout: must be a number of " \
           f"seconds from 0.1 to 3600, got {value!r}" in err, err  # fmt: skip


@pytest.mark.parametrize("command", ["plugins", "doctor", "env"])
def test_json_is_json_on_stdout(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main([command, "--json", "--plugin-timeout", "3600"])
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data, dict)
    if command == "doctor":
        assert status == (0 if data["ok"] else 1)
        assert data["environment"]["torch"]["version"]  # doctor's JSON holds the environment
    elif command == "env":
        assert status == 0


def test_demo_help_explains_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--seed SEED seed of the initial weights" in text
    # The default loss scale reads as people write it, not as 1.04858e+06.
    assert "default 2**20 = 1048576" in text and "e+0" not in text
    assert "'pp2xdp2'" in text and "pp2,dp2" not in text


def test_demo_refuses_the_old_mesh_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--mesh", "pp2,dp2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardscale demo: error: --mesh 'pp2,dp2': one mesh is expected"), err
    assert "'pp2xdp2'" in err


def test_plugin_timeout_bound_in_the_registry() -> None:
    # The registry refuses a limit the thread join cannot take, instead of failing every plugin.
    import threading

    from shardscale.core import Registry

    fresh = Registry()
    with pytest.raises(ValueError, match="import_timeout must be a number of seconds > 0 and <="):
        fresh.load(import_timeout=threading.TIMEOUT_MAX * 10)
    fresh.load(import_timeout=3600.0)  # the CLI's top of range loads every plugin
    assert "core" in {p.name for p in fresh.plugins()}
    assert not [f for f in fresh.failures() if "Overflow" in f.error]
