"""Where plugins come from, and what the user can do about the ones they do not want.

Real distributions, really installed: the tests build tiny wheels in a
temporary directory, ``pip install --target`` them there (never into the
environment under test, which other tests share), and run the checks in a
fresh interpreter whose ``PYTHONPATH`` holds that directory, so
``importlib.metadata`` finds them as it finds any installed distribution:

* ``shardscale-test-boom`` — a plugin whose import leaves a sentinel file and
  raises. ``SHARDSCALE_DISABLE_PLUGINS`` must stop it *before* import (no
  sentinel); without it the failure is reported with its distribution and the
  other plugins still load. The same wheel lists a module under another
  entry-point group that must never be imported.
* ``shardscale-test-dup-a`` and ``-dup-b`` — two plugins claiming the backend
  name ``dup``: looking it up names both distributions, ``<distribution>:dup``
  picks one (as an argument or in ``SHARDSCALE_BACKEND``).
* ``shardscale-test-twin-a`` and ``-twin-b`` — two distributions with the same
  entry-point name: neither loads (never settled by discovery order), both are
  reported naming each other, the rest of the registry works; disabling one
  loads the other.
* ``evilmod.py`` — a plain module on the path: names in environment variables
  are looked up among registered plugins only, never imported.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from shardscale.core import PluginConflictError, PluginNotFoundError, Registry, hookimpl
from shardscale.core.plugins import IN_PROCESS, CompletedHandle

_BACKEND_MODULE = """
from shardscale.core import hookimpl
from shardscale.core.plugins import CompletedHandle

class DupBackend:
    name = "{backend}"
    origin = "{origin}"

    def all_reduce(self, tensor, *, op, group):
        return CompletedHandle()

    def world_size(self, group):
        return 1

    def rank(self, group):
        return 0

    def group_ranks(self, group):
        return (0,)

@hookimpl
def shardscale_collective_backends():
    return [DupBackend]
"""

_SENTINEL_MODULE = """
import os, pathlib
pathlib.Path(os.environ["SHARDSCALE_TEST_SENTINELS"], "{sentinel}").touch()
raise RuntimeError("{sentinel}: this module must never be imported")
"""


def _wheel(
    out: Path, dist: str, modules: dict[str, str], entry_points: dict[str, dict[str, str]]
) -> Path:
    """Write a minimal, valid pure-Python wheel by hand (no build backend, no network)."""
    stem = dist.replace("-", "_")
    version = "0.0.1"
    info = f"{stem}-{version}.dist-info"
    files: dict[str, bytes] = {
        f"{name}.py": textwrap.dedent(src).encode() for name, src in modules.items()
    }
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    )
    files[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: shardscale-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    eps = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) + "\n"
        for group, items in entry_points.items()
    )
    files[f"{info}/entry_points.txt"] = eps.encode()
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def _pip_install(target: Path, wheels: list[Path]) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(target),
            *map(str, wheels),
        ],
        check=True,
        timeout=180,
    )


# The checks that run in the fresh interpreter. Scenarios run in this order on purpose:
# the ones that must *not* import the boom plugin come before the one that does.
_CHILD = r"""
import json, os, sys
from pathlib import Path
from shardscale.core import Registry

sentinels = Path(os.environ["SHARDSCALE_TEST_SENTINELS"])
twins = os.environ.pop("SHARDSCALE_TEST_TWINS")

def probe(fn):
    try:
        value = fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"ok": getattr(value, "origin", getattr(value, "name", repr(value)))}

def scenario(disable, *, backends=(), env_backends=()):
    os.environ.pop("SHARDSCALE_BACKEND", None)
    if disable is None:
        os.environ.pop("SHARDSCALE_DISABLE_PLUGINS", None)
    else:
        os.environ["SHARDSCALE_DISABLE_PLUGINS"] = disable
    reg = Registry()
    out = {"load": probe(lambda: reg.load() or reg)}
    if "error" not in out["load"]:
        out["failures"] = [
            {"name": f.name, "distribution": f.distribution, "error": f.error, "blocked": f.blocked}
            for f in reg.failures()
        ]
        out["fixes"] = [
            {"name": f.name, "distribution": f.distribution, "fix": f.fix, "stage": f.stage}
            for f in reg.failures()
        ]
        out["plugins"] = {p.name: p.distribution for p in reg.plugins()}
        out["backends"] = reg.names("backend")
        out["lookups"] = {b: probe(lambda b=b: reg.backend_class(b)) for b in backends}
        env = {}
        for b in env_backends:
            os.environ["SHARDSCALE_BACKEND"] = b
            env[b] = probe(lambda: reg.make_backend())
        os.environ.pop("SHARDSCALE_BACKEND", None)
        out["env_lookups"] = env
    out["sentinels"] = sorted(p.name for p in sentinels.iterdir())
    out["modules"] = sorted(m for m in sys.modules if m.startswith(("shardscale_test", "evilmod")))
    return out

DUP = ["dup", "shardscale-test-dup-a:dup", "dupb:dup", "shardscale-test-nope:dup"]
EVIL = ["evilmod", "evilmod:dup", "evilmod.EvilBackend", os.path.join(sys.path[0], "evilmod.py")]
results = {
    "disable_by_entry_point": scenario("boom,dupb", backends=["dup"]),
    "disable_by_distribution": scenario(" shardscale-test-boom , "),
    "enabled": scenario(None, backends=DUP, env_backends=["shardscale-test-dup-b:dup", *EVIL]),
}
sys.path.append(twins)
results["twins"] = scenario(None, backends=["twin", "local"])
results["twins_again"] = scenario(None, backends=["twin"])
results["twins_disabled"] = scenario("shardscale-test-twin-b", backends=["twin"])
print("RESULTS=" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def trust_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not available in this interpreter")
    root = tmp_path_factory.mktemp("plugin-trust")
    wheels = root / "wheels"
    wheels.mkdir()
    site, twins, sentinels = root / "site", root / "twins", root / "sentinels"
    sentinels.mkdir()
    boom = _wheel(
        wheels,
        "shardscale-test-boom",
        {
            "shardscale_test_boom": _SENTINEL_MODULE.format(sentinel="boom-imported"),
            "shardscale_test_other_group": _SENTINEL_MODULE.format(sentinel="other-group-imported"),
        },
        {
            "shardscale": {"boom": "shardscale_test_boom"},
            "shardscale_extras": {"other": "shardscale_test_other_group"},
        },
    )
    dups = [
        _wheel(
            wheels,
            f"shardscale-test-dup-{x}",
            {f"shardscale_test_dup_{x}": _BACKEND_MODULE.format(backend="dup", origin=x)},
            {"shardscale": {f"dup{x}": f"shardscale_test_dup_{x}"}},
        )
        for x in "ab"
    ]
    twin_wheels = [
        _wheel(
            wheels,
            f"shardscale-test-twin-{x}",
            {f"shardscale_test_twin_{x}": _BACKEND_MODULE.format(backend="twin", origin=x)},
            {"shardscale": {"twin": f"shardscale_test_twin_{x}"}},
        )
        for x in "ab"
    ]
    _pip_install(site, [boom, *dups])
    _pip_install(twins, twin_wheels)
    (site / "evilmod.py").write_text(_SENTINEL_MODULE.format(sentinel="evilmod-imported"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSCALE_")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(
                os.pathsep
            ),
            "SHARDSCALE_TEST_SENTINELS": str(sentinels),
            "SHARDSCALE_TEST_TWINS": str(twins),
            "OMP_NUM_THREADS": "1",
        }
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS="))
    yield json.loads(line.removeprefix("RESULTS="))


def test_disabled_plugin_is_blocked_before_import(trust_results: dict[str, Any]) -> None:
    for scenario in ("disable_by_entry_point", "disable_by_distribution"):
        res = trust_results[scenario]
        assert "error" not in res["load"], res["load"]
        # The proof: its import would have left a sentinel and put it in sys.modules.
        assert res["sentinels"] == [], scenario
        assert "shardscale_test_boom" not in res["modules"], scenario
        blocked = [f for f in res["failures"] if f["name"] == "boom"]
        assert blocked == [
            {
                "name": "boom",
                "distribution": "shardscale-test-boom",
                "error": "blocked by SHARDSCALE_DISABLE_PLUGINS",
                "blocked": True,
            }
        ], scenario
        assert res["plugins"]["core"] == "shardscale-core"
        assert "local" in res["backends"]


def test_a_plugin_that_fails_at_import_is_reported_and_the_others_load(
    trust_results: dict[str, Any],
) -> None:
    res = trust_results["enabled"]
    assert "error" not in res["load"], res["load"]
    assert "boom-imported" in res["sentinels"]  # the control: it really was imported
    failure = next(f for f in res["failures"] if f["name"] == "boom")
    assert failure["distribution"] == "shardscale-test-boom"
    assert not failure["blocked"]
    assert failure["error"].startswith("RuntimeError: boom-imported")
    assert res["plugins"]["core"] == "shardscale-core"
    assert res["plugins"]["dupa"] == "shardscale-test-dup-a"
    assert "local" in res["backends"] and "dup" in res["backends"]
    # A failed lookup mentions the plugin that did not load instead of only "not installed".
    missing = res["lookups"]["shardscale-test-nope:dup"]
    assert missing["error"] == "PluginNotFoundError"
    assert "boom (shardscale-test-boom): RuntimeError" in missing["message"]


def test_only_the_shardscale_entry_point_group_is_read(trust_results: dict[str, Any]) -> None:
    for res in trust_results.values():
        assert "other-group-imported" not in res["sentinels"]
        assert "shardscale_test_other_group" not in res["modules"]


def test_two_plugins_claiming_one_backend_name(trust_results: dict[str, Any]) -> None:
    res = trust_results["enabled"]
    clash = res["lookups"]["dup"]
    assert clash["error"] == "PluginConflictError"
    assert "shardscale-test-dup-a" in clash["message"]
    assert "shardscale-test-dup-b" in clash["message"]
    assert "<distribution>:dup" in clash["message"]
    # Picking one explicitly, by distribution or by plugin name, as an argument or in the env.
    assert res["lookups"]["shardscale-test-dup-a:dup"] == {"ok": "a"}
    assert res["lookups"]["dupb:dup"] == {"ok": "b"}
    assert res["env_lookups"]["shardscale-test-dup-b:dup"] == {"ok": "b"}
    # Disabling one of them also resolves the clash.
    assert trust_results["disable_by_entry_point"]["lookups"]["dup"] == {"ok": "a"}


def test_names_from_the_environment_are_never_imported(trust_results: dict[str, Any]) -> None:
    res = trust_results["enabled"]
    evil = {k: v for k, v in res["env_lookups"].items() if "evilmod" in k}
    assert len(evil) == 4
    for spec, outcome in evil.items():
        assert outcome.get("error") == "PluginNotFoundError", (spec, outcome)
        assert "SHARDSCALE_BACKEND" in outcome["message"]
    for scenario in trust_results.values():
        assert "evilmod-imported" not in scenario["sentinels"]
        assert "evilmod" not in scenario["modules"]


def test_two_distributions_with_one_entry_point_name(trust_results: dict[str, Any]) -> None:
    for key in ("twins", "twins_again"):  # the same outcome every time: no half-loaded registry
        res = trust_results[key]
        assert "error" not in res["load"], res["load"]
        twins = [f for f in res["failures"] if f["name"] == "twin"]
        assert sorted(f["distribution"] for f in twins) == [
            "shardscale-test-twin-a",
            "shardscale-test-twin-b",
        ]
        for failure in twins:
            assert not failure["blocked"]
            assert "shardscale-test-twin-a" in failure["error"]
            assert "shardscale-test-twin-b" in failure["error"]
        fixes = [f for f in res["fixes"] if f["name"] == "twin"]
        assert {f["stage"] for f in fixes} == {"conflict"}
        assert all("SHARDSCALE_DISABLE_PLUGINS=shardscale-test-twin-" in f["fix"] for f in fixes)
        # Neither twin was picked by discovery order; the other plugins still work.
        assert "twin" not in res["backends"] and "twin" not in res["plugins"]
        assert res["lookups"]["twin"]["error"] == "PluginNotFoundError"
        assert "two installed distributions" in res["lookups"]["twin"]["message"]
        assert res["plugins"]["core"] == "shardscale-core" and "local" in res["backends"]
    assert trust_results["twins"]["lookups"]["local"] == {"ok": "local"}
    fixed = trust_results["twins_disabled"]
    assert "error" not in fixed["load"], fixed["load"]
    assert fixed["lookups"]["twin"] == {"ok": "a"}


# -- in-process registration ------------------------------------------------------------------


class _Tap:
    name: ClassVar[str] = "inproc-backend"

    def all_reduce(self, tensor: Any, *, op: Any, group: Any) -> CompletedHandle:
        return CompletedHandle()

    def world_size(self, group: Any) -> int:
        return 1

    def rank(self, group: Any) -> int:
        return 0

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return (0,)


class _InProcessPlugin:
    @hookimpl
    def shardscale_collective_backends(self) -> list[type]:
        return [_Tap]


def test_in_process_registration_and_unregistration() -> None:
    reg = Registry()
    with pytest.raises(PluginNotFoundError):
        reg.backend_class("inproc-backend")
    name = reg.register(_InProcessPlugin(), name="inproc")
    try:
        assert reg.backend_class("inproc-backend") is _Tap
        assert reg.backend_class("inproc:inproc-backend") is _Tap
        info = next(p for p in reg.plugins() if p.name == "inproc")
        assert info.distribution == IN_PROCESS
        with pytest.raises(PluginConflictError, match="already registered"):
            reg.register(_InProcessPlugin(), name="inproc")
    finally:
        reg.unregister(name)
    with pytest.raises(PluginNotFoundError):
        reg.backend_class("inproc-backend")
