"""Misbehaving plugins, installed as real distributions, cannot break the house.

The distributions in ``integration_tests/plugins/misbehaving/`` are built with
their own build backend (hatchling) and installed with pip, all at once, into a
throwaway folder once per module (``pip install --target``: the environment
under test, which other tests share, is never touched). Small probes then run
in fresh interpreters whose ``PYTHONPATH`` holds that folder, so
``importlib.metadata`` finds the plugins exactly as it finds any installed
distribution. What they do wrong is what the issue found in the wild:

* a hook that raises; a hook that returns a bare class; kernels whose
  ``supports()`` raises; an adapter whose priority is ``"high"``; an adapter
  whose ``claims()`` raises during a step; an observer that raises;
* a module that runs ``argparse`` at import (``SystemExit`` with the user's
  own flags called "unrecognized"), one that raises ``KeyboardInterrupt``, and
  one whose import never returns (``doctor`` and ``plugins`` must still finish);
* a second backend named ``c10d``; two adapters (and two kernels) of equal
  priority; a distribution spelled ``RT_Evil.Plugin`` that must be blockable
  as ``rt-evil-plugin`` before it is imported; a backend that offers itself to
  the automatic choice, so core need not name ``c10d``.

Every probe runs with all of them installed: ``local``, ``c10d``, the adapters,
the kernels and the CLI must keep working, and each bad plugin must be named
with its distribution, version and fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MISBEHAVING = Path(__file__).parent / "plugins" / "misbehaving"
#: Each bad plugin's entry-point name -> (distribution, version), read from its pyproject.
META: dict[str, tuple[str, str]] = {}
for _pyproject in sorted(MISBEHAVING.glob("*/pyproject.toml")):
    _project = tomllib.loads(_pyproject.read_text())["project"]
    for _ep in _project["entry-points"]["shardscale"]:
        META[_ep] = (_project["name"], _project["version"])

#: The plugins that fail in every probe run with the user's own flags, and where they fail.
BROKEN = {
    "bad_hook_raises": "hook",
    "bad_bare_class": "hook",
    "bad_priority": "item",
    "bad_argparse": "import",
}
#: Those that fail only once a step asks them something (set aside at that moment).
BROKEN_AT_STEP = {"bad_claims": "claims", "bad_supports": "supports", "bad_observer": "observer"}
USER_FLAGS = ["--lr", "3"]  # the user's own script flags, which bad_argparse trips over


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("pip", "hatchling"):
        if importlib.util.find_spec(tool) is None:
            pytest.fail(
                f"{tool} is needed to build and install the test plugins of {MISBEHAVING}; "
                f"'pip install {tool}' (nox's test sessions install it)"
            )
    target = tmp_path_factory.mktemp("misbehaving-site")
    dists = sorted(str(p.parent) for p in MISBEHAVING.glob("*/pyproject.toml"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check",
         "--target", str(target), *dists],
        check=True, timeout=300,
    )  # fmt: skip
    return target


_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _env(site: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SHARDSCALE_", "TORCHELASTIC_")) and k not in _LAUNCH_VARS
    }
    path = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env.update({"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def _run(
    site: Path, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], env=_env(site, env), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def _probe(site: Path, code: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = _run(site, ["-c", code, *USER_FLAGS], env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")), None)
    assert line is not None, proc.stdout + proc.stderr
    results: dict[str, Any] = json.loads(line.removeprefix("RESULTS="))
    results["stderr"] = proc.stderr
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- one process with every bad plugin installed: the house still stands -----------------------

_STEPS = r"""
import json, sys, warnings
import torch
import torch.distributed as dist

warnings.simplefilter("always")
caught = warnings.catch_warnings(record=True)
log = caught.__enter__()

from shardscale.core import ShardedGradScaler, get_registry

def outcome(fn):
    try:
        value = fn()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"ok": value}

def two_steps(scaler, make):
    # init_scale 16: a grad of 16 unscales to 1, so SGD(lr=1) takes a ones parameter to zeros;
    # then an inf grad must skip the step and halve the scale (torch's backoff 0.5).
    param = torch.nn.Parameter(make(torch.ones(4)))
    opt = torch.optim.SGD([param], lr=1.0)
    results = []
    for grad in (torch.full((4,), 16.0), torch.tensor([16.0, float("inf"), 16.0, 16.0])):
        opt.zero_grad()
        scaler.scale(torch.ones(()))
        param.grad = make(grad)
        scaler.step(opt)
        scaler.update()
        local = param.detach().full_tensor() if hasattr(param, "full_tensor") else param.detach()
        results.append(local.tolist())
    return results + [scaler.get_scale()]

plain = lambda t: t
reg = get_registry()
out = {"names": {k: reg.names(k) for k in ("backend", "middleware", "adapter", "kernels")}}
out["local"] = outcome(lambda: two_steps(ShardedGradScaler("cpu", backend="local", init_scale=16.0), plain))
out["kernels_cpu"] = outcome(lambda: reg.kernels_for(torch.device("cpu")).name)
out["kernels_meta"] = outcome(lambda: reg.kernels_for(torch.device("meta")).name)
tagged = torch.nn.Parameter(torch.ones(2))
tagged._tie_test = True
out["tie_adapter"] = outcome(lambda: reg.adapter_for(tagged).name)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out["automatic"] = outcome(lambda: type(reg.make_backend()).__name__)
out["c10d_by_name"] = outcome(lambda: type(reg.make_backend("c10d")).__name__)
out["c10d_qualified"] = outcome(lambda: type(reg.make_backend("shardscale-collectives:c10d")).__name__)
out["c10d_steps"] = outcome(lambda: two_steps(ShardedGradScaler("cpu", init_scale=16.0), plain))
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
mesh = init_device_mesh("cpu", (1,))
shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])
out["dtensor_adapter"] = outcome(lambda: reg.adapter_for(torch.nn.Parameter(shard(torch.ones(4)))).name)
out["dtensor_steps"] = outcome(lambda: two_steps(ShardedGradScaler("cpu", init_scale=16.0), shard))
def tie_step():
    scaler = ShardedGradScaler("cpu", init_scale=16.0)
    opt = torch.optim.SGD([tagged], lr=1.0)
    scaler.scale(torch.ones(()))
    tagged.grad = torch.ones(2)
    scaler.step(opt)
out["tie_step"] = outcome(tie_step)
dist.destroy_process_group()

import shardscale_bad_claims, shardscale_bad_observer
out["claims_calls"] = len(shardscale_bad_claims.CALLS)
out["observer_calls"] = shardscale_bad_observer.CALLS
out["failures"] = [
    {"name": f.name, "distribution": f.distribution, "version": f.version, "stage": f.stage,
     "error": f.error, "fix": f.fix, "blocked": f.blocked}
    for f in reg.failures()
]
out["warnings"] = [f"{w.category.__name__}: {w.message}" for w in log]
print("RESULTS=" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def steps(site: Path) -> dict[str, Any]:
    return _probe(site, _STEPS)


def _failure(results: dict[str, Any], name: str) -> dict[str, Any]:
    found = [f for f in results["failures"] if f["name"] == name]
    assert len(found) == 1, (name, results["failures"])
    return found[0]


def test_every_failure_names_plugin_distribution_version_and_fix(steps: dict[str, Any]) -> None:
    for name, stage in {**BROKEN, **BROKEN_AT_STEP}.items():
        failure = _failure(steps, name)
        dist, version = META[name]
        assert (failure["distribution"], failure["version"]) == (dist, version), failure
        assert failure["stage"] == stage, failure
        assert not failure["blocked"]
        assert f"SHARDSCALE_DISABLE_PLUGINS={name}" in failure["fix"]
        assert dist in failure["fix"]
        assert "Traceback" not in failure["error"] and "\n" not in failure["error"]
        # The user hears about it once, as a warning naming the plugin and the fix.
        assert any(
            w.startswith("PluginWarning") and repr(name) in w and failure["fix"] in w
            for w in steps["warnings"]
        ), (name, steps["warnings"])


def test_what_each_failure_says(steps: dict[str, Any]) -> None:
    assert "RuntimeError: bad_hook_raises" in _failure(steps, "bad_hook_raises")["error"]
    assert "instead of a list" in _failure(steps, "bad_bare_class")["error"]
    assert (
        "returned an adapter whose 'priority' is not an int (higher wins): got 'high'"
        in (_failure(steps, "bad_priority")["error"])
    )
    argparse = _failure(steps, "bad_argparse")["error"]
    assert "SystemExit(2)" in argparse and "unrecognized arguments: --lr 3" in argparse
    assert "RuntimeError: bad_claims" in _failure(steps, "bad_claims")["error"]
    assert "RuntimeError: bad_supports" in _failure(steps, "bad_supports")["error"]
    assert "RuntimeError: bad_observer" in _failure(steps, "bad_observer")["error"]
    # argparse's complaint is attributed to the plugin, not printed as if it were the user's.
    assert "unrecognized arguments" not in steps["stderr"].replace(argparse, "")


def test_the_rest_of_a_failing_plugin_and_of_the_registry_works(steps: dict[str, Any]) -> None:
    names = steps["names"]
    assert "passthrough" in names["middleware"]  # bad_hook_raises' other hook
    assert {"local", "c10d", "gloo"} <= set(names["backend"])
    assert {"plain", "dtensor", "fsdp1"} <= set(names["adapter"])
    assert "high" not in names["adapter"] and "bare" not in names["backend"]
    assert {"foreach", "blas-dot"} <= set(names["kernels"])


def test_local_c10d_and_the_dtensor_adapter_still_step(steps: dict[str, Any]) -> None:
    expected = [[0.0] * 4, [0.0] * 4, 8.0]  # stepped, then skipped the inf and backed off
    for key in ("local", "c10d_steps", "dtensor_steps"):
        assert steps[key] == {"ok": expected}, (key, steps[key])
    assert steps["automatic"] == {"ok": "C10dBackend"}
    assert steps["c10d_qualified"] == {"ok": "C10dBackend"}
    assert steps["dtensor_adapter"] == {"ok": "dtensor"}


def test_a_raising_claims_or_supports_is_asked_once_then_set_aside(steps: dict[str, Any]) -> None:
    # bad_claims (priority 50) outranks every real adapter: asked about the first parameter,
    # it raised, and was never asked again; bad_supports (100) likewise for kernels.
    assert steps["claims_calls"] == 1
    assert steps["kernels_cpu"] == {"ok": "blas-dot"}
    # The observer raised at the first update and was not called again; the steps went on.
    assert steps["observer_calls"] == [1]


def test_a_second_c10d_is_an_error_naming_both(steps: dict[str, Any]) -> None:
    clash = steps["c10d_by_name"]
    assert clash["error"] == "PluginConflictError"
    assert "shardscale-collectives" in clash["message"]
    assert META["rival_c10d"][0] in clash["message"]


def test_equal_priorities_are_an_error_naming_both(steps: dict[str, Any]) -> None:
    for key in ("tie_adapter", "kernels_meta", "tie_step"):
        outcome = steps[key]
        assert "error" in outcome, (key, outcome)
        assert META["tie_a"][0] in outcome["message"] and META["tie_b"][0] in outcome["message"]
        assert "same priority" in outcome["message"]
    assert steps["tie_adapter"]["error"] == "PluginConflictError"


# -- blocking, interruption and the automatic backend ------------------------------------------

_TRUST = r"""
import json, os, sys, warnings
from pathlib import Path
import torch.distributed as dist
from shardscale.core import PluginWarning, Registry

sentinels = Path(os.environ["SHARDSCALE_TEST_SENTINELS"])
out = {}

def scenario(disable, **extra):
    os.environ["SHARDSCALE_DISABLE_PLUGINS"] = disable
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        reg = Registry()
        res = {
            "backends": reg.names("backend"),
            "adapters": reg.names("adapter"),
            "blocked": sorted((f.name, f.distribution) for f in reg.failures() if f.blocked),
            "unmatched": reg.unmatched_disable_names(),
        }
        for key, fn in extra.items():
            try:
                res[key] = {"ok": type(fn(reg)).__name__}
            except Exception as exc:
                res[key] = {"error": type(exc).__name__, "message": str(exc)}
    res["warnings"] = [str(w.message) for w in log if w.category is PluginWarning]
    res["sentinels"] = sorted(p.name for p in sentinels.iterdir())
    res["modules"] = sorted(m for m in ("shardscale.core._plugin", "rt_evil_plugin") if m in sys.modules)
    return res

# The order matters: an imported module stays imported, so each scenario blocks what a later
# one must see unimported. A Ctrl-C while plugins import stops loading and leaves the
# registry unloaded.
os.environ["SHARDSCALE_DISABLE_PLUGINS"] = "Shardscale_Core,rt_evil"
os.environ["SHARDSCALE_TEST_INTERRUPT"] = "1"
reg = Registry()
try:
    reg.load()
    out["interrupt"] = "not raised"
except KeyboardInterrupt:
    out["interrupt"] = "raised"
out["interrupt_loaded"] = reg._loaded
os.environ.pop("SHARDSCALE_TEST_INTERRUPT")
out["after_interrupt"] = sorted(p.name for p in reg.plugins())

# Distribution names as pip spells them; then the built-ins by their distribution name.
out["evil"] = scenario(" rt-evil-plugin , no-such-plugin,shardscale-core")
out["core"] = scenario("Shardscale_Core", automatic=lambda r: r.make_backend())
os.environ.pop("SHARDSCALE_DISABLE_PLUGINS")

# The automatic choice under a process group is whatever backend declares the highest
# automatic_priority: c10d (0) over auto-example (-1), and auto-example once c10d is blocked.
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
out["auto_all"] = scenario("nothing-blocked", automatic=lambda r: r.make_backend())
out["auto_no_collectives"] = scenario("shardscale-collectives", automatic=lambda r: r.make_backend())
dist.destroy_process_group()
print("RESULTS=" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def trust(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sentinels = tmp_path_factory.mktemp("sentinels")
    return _probe(site, _TRUST, env={"SHARDSCALE_TEST_SENTINELS": str(sentinels)})


def test_blocking_the_built_ins_really_blocks_them(trust: dict[str, Any]) -> None:
    res = trust["core"]
    assert res["blocked"] == [["core", "shardscale-core"]]
    assert "local" not in res["backends"] and "plain" not in res["adapters"]
    assert "shardscale.core._plugin" not in res["modules"]  # never imported: no fallback
    assert res["unmatched"] == []
    # What remains is said plainly when asked for what is gone.
    assert res["automatic"]["error"] == "PluginNotFoundError"
    assert "core (shardscale-core): blocked" in res["automatic"]["message"]


def test_distribution_names_are_matched_as_pip_spells_them(trust: dict[str, Any]) -> None:
    res = trust["evil"]
    assert res["blocked"] == [["core", "shardscale-core"], ["rt_evil", "RT_Evil.Plugin"]]
    assert res["sentinels"] == [] and "rt_evil_plugin" not in res["modules"]
    assert "evil" not in res["backends"]


def test_a_block_name_that_matches_nothing_is_reported(trust: dict[str, Any]) -> None:
    res = trust["evil"]
    assert res["unmatched"] == ["no-such-plugin"]
    assert any("'no-such-plugin'" in w and "block nothing" in w for w in res["warnings"])
    assert not any("rt-evil-plugin" in w and "block nothing" in w for w in res["warnings"])


def test_a_keyboard_interrupt_while_loading_propagates_and_leaves_nothing(
    trust: dict[str, Any],
) -> None:
    assert trust["interrupt"] == "raised"
    assert trust["interrupt_loaded"] is False
    # The next lookup loads everything (but the blocked core), the interrupting plugin included.
    assert {"collectives", "bad_interrupt"} <= set(trust["after_interrupt"])
    assert "core" not in trust["after_interrupt"] and "rt_evil" not in trust["after_interrupt"]


def test_the_automatic_backend_is_the_declared_one(trust: dict[str, Any]) -> None:
    assert trust["auto_all"]["automatic"] == {"ok": "C10dBackend"}
    assert trust["auto_no_collectives"]["automatic"] == {"ok": "AutoBackend"}


# -- the command line ------------------------------------------------------------------------


def test_plugins_json_lists_every_failure_without_a_traceback(site: Path) -> None:
    proc = _run(site, ["-m", "shardscale.cli", "plugins", "--json"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    failed = {f["name"]: f for f in data["failures"]}
    for name, stage in BROKEN.items():
        assert failed[name]["distribution"] == META[name][0]
        assert failed[name]["version"] == META[name][1]
        assert failed[name]["stage"] == stage and failed[name]["fix"]
    # The listing itself works, with the priority that orders adapters.
    local = next(i for i in data["items"] if i["name"] == "local")
    assert local["usable"] and local["distribution"] == "shardscale-core"
    plain = next(i for i in data["items"] if i["name"] == "plain")
    assert plain["priority"] == 0


def test_plugins_table_names_every_failure_without_a_traceback(site: Path) -> None:
    proc = _run(site, ["-m", "shardscale.cli", "plugins"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for name in BROKEN:
        assert f"plugin {name!r} ({META[name][0]} {META[name][1]}) FAILED" in proc.stdout


def _findings(proc: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return list(json.loads(proc.stdout)["findings"])


def test_doctor_names_each_broken_plugin_and_exits_1(site: Path) -> None:
    proc = _run(site, ["-m", "shardscale.cli", "doctor", "--json"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    findings = _findings(proc)
    errors = [f for f in findings if f["status"] == "error"]
    for name in (*BROKEN, "bad_claims", "bad_supports"):
        hit = [f for f in errors if f"{name} ({META[name][0]} {META[name][1]})" in f["detail"]]
        assert hit and hit[0]["fix"], (name, errors)
    # The second 'c10d' and the non-int priority are errors, not "nothing is broken".
    clash = [f for f in errors if "'c10d'" in f["detail"]]
    assert clash and META["rival_c10d"][0] in clash[0]["detail"]
    # And yet a scaler really stepped here, with the kernels a scaler would use.
    step = next(f for f in findings if f["check"] == "scaler step")
    assert step["status"] == "ok", step
    assert next(f for f in findings if f["check"] == "kernels (cpu)")["detail"].startswith(
        "blas-dot"
    )


@pytest.mark.parametrize("command", ["plugins", "doctor"])
def test_a_plugin_whose_import_never_returns_is_a_failure_not_a_hang(
    site: Path, command: str
) -> None:
    # bad_hang's import waits forever: the command gives it --plugin-timeout seconds, names
    # it (and its distribution) as a failure, and finishes with everything else reported.
    # Without the limit the command hangs: the subprocess timeout turns that into a failure.
    # The limit is above the loader's few seconds of silence, so it must say whom it waits for.
    limit = 4
    argv = ["-m", "shardscale.cli", command, "--json", "--plugin-timeout", str(limit)]
    proc = _run(site, argv, env={"SHARDSCALE_TEST_HANG": "1"}, timeout=150)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)  # what the plugin printed did not leak into the JSON
    dist, version = META["bad_hang"]
    waiting = [line for line in proc.stderr.splitlines() if "waiting for plugin" in line]
    assert waiting == [
        f"shardscale: waiting for plugin 'bad_hang' from {dist} to import (shardscale_bad_hang); "
        f"it is given up after {limit} s"
    ], proc.stderr
    if command == "plugins":
        hung = _failure(data, "bad_hang")
        assert (hung["distribution"], hung["version"], hung["stage"]) == (dist, version, "import")
        assert f"did not return within {limit} s" in hung["error"]
        assert "waiting for the license server" in hung["error"]
        assert "SHARDSCALE_DISABLE_PLUGINS=bad_hang" in hung["fix"]
        # The rest of the listing is all there.
        assert {"local", "c10d", "plain"} <= {i["name"] for i in data["items"]}
        return
    errors = [f for f in data["findings"] if f["status"] == "error"]
    hit = [f for f in errors if f"bad_hang ({dist} {version})" in f["detail"]]
    assert hit and f"did not return within {limit} s" in hit[0]["detail"], errors
    assert "SHARDSCALE_DISABLE_PLUGINS=bad_hang" in hit[0]["fix"]
    step = next(f for f in data["findings"] if f["check"] == "scaler step")
    assert step["status"] == "ok", step


def _launch(port: int) -> dict[str, str]:
    return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}  # fmt: skip


def test_doctor_connect_does_not_blame_the_rendezvous_for_a_plugin_conflict(site: Path) -> None:
    env = {**_launch(_free_port()), "SHARDSCALE_BACKEND": "c10d"}
    proc = _run(site, ["-m", "shardscale.cli", "doctor", "--json", "--connect"], env=env)
    assert proc.returncode == 1
    findings = _findings(proc)
    backend = next(f for f in findings if f["check"] == "backend")
    assert backend["status"] == "error" and META["rival_c10d"][0] in backend["detail"]
    group = next(f for f in findings if f["check"] == "process group")
    assert group["status"] == "error"
    assert "reachable" not in group["detail"] + group["fix"]
    assert "not attempted" in group["detail"]


def test_doctor_connect_steps_a_scaler_across_the_group(site: Path) -> None:
    env = {**_launch(_free_port()), "SHARDSCALE_BACKEND": "shardscale-collectives:c10d"}
    proc = _run(site, ["-m", "shardscale.cli", "doctor", "--json", "--connect"], env=env)
    findings = _findings(proc)
    group = next(f for f in findings if f["check"] == "process group")
    assert group["status"] == "ok", group
    step = next(f for f in findings if f["check"] == "scaler step")
    assert step["status"] == "ok", step
    assert proc.returncode == 1  # the broken plugins are still reported


# -- across ranks: a claims() that raises on one rank only -----------------------------------


def _one_rank_claims_raises_case() -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    from shardscale.core import GradShard, ShardedGradScaler, get_registry, hookimpl

    rank = dist.get_rank()

    class FlakyAdapter:
        name = "flaky"
        priority = 70

        def claims(self, param: torch.Tensor) -> bool:
            if rank == 1:
                raise RuntimeError("flaky: rank-local trouble")
            return type(param) is torch.nn.Parameter

        def describe(self, param: Any, grad: torch.Tensor, ctx: Any) -> GradShard:
            return GradShard(local=grad, counts=ctx.rank == 0)

    class Plugin:
        @hookimpl
        def shardscale_grad_adapters(self) -> list[object]:
            return [FlakyAdapter()]

    reg = get_registry()
    name = reg.register(Plugin(), name="flaky-plugin")
    try:
        scaler = ShardedGradScaler("cpu", init_scale=16.0)
        param = torch.nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([param], lr=1.0)
        seen = []
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            for poison_rank in (None, 1):  # then an inf on rank 1 only: both ranks must skip
                opt.zero_grad()
                scaler.scale(torch.ones(()))
                param.grad = torch.full((4,), 16.0)
                if rank == poison_rank:
                    param.grad[0] = float("inf")
                scaler.step(opt)
                scaler.update()
                seen.append(param.detach().tolist())
        failures = [f.stage for f in reg.failures() if f.name == "flaky-plugin"]
        return {"params": seen, "scale": scaler.get_scale(), "failures": failures}
    finally:
        reg.unregister(name)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_claims_raising_on_one_rank_leaves_the_step_identical(pool2: Any) -> None:
    results = pool2.run(_one_rank_claims_raises_case, timeout=60)
    expected = {"params": [[0.0] * 4, [0.0] * 4], "scale": 8.0}
    for rank, result in enumerate(results):
        assert {k: result[k] for k in expected} == expected, (rank, result)
    assert results[0]["failures"] == [] and results[1]["failures"] == ["claims"]


@pytest.fixture(autouse=True, scope="module")
def _no_leftovers() -> Iterator[None]:
    yield
    # The probes ran in other interpreters: this process never saw the bad plugins.
    from shardscale.core import get_registry

    assert not any(p.name in META for p in get_registry().plugins())
