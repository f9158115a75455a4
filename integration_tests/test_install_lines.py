"""The first install command of getting-started and of each integration page works as written.

Each page's first ``pip install`` line is read out of the Markdown of a fresh ``git clone``
of this repository (so a broken docs line fails here), and run as written, from the clone's
root, in a fresh virtual environment; then ``pip check`` must pass and the page's package
must import (for getting-started, the ``shardscale`` command must run).

[Note: torch in the fresh environments]
Installing torch into each fresh environment takes minutes, so torch (and the distributions
it requires, where installed) is placed in each one first, hard-linked from the environment
running the tests: it is then an ordinary installed distribution there (pip sees it, can
replace it), and the environment has nothing else -- no ``--system-site-packages``, which
would hide a dependency a line forgets. Where a line pins another torch than the one
running, pip installs that one, as it would for a user. The frameworks are constrained to
the versions ``noxfile.py`` tests (``PIP_CONSTRAINT``), which the warm pip cache holds.

Cost: 11.5 min of wall time (4.2 min of CPU) for the six pages, two at a time, on a 2-core
machine shared with other jobs, with a warm pip cache.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Page -> Python code that must run in its environment after the install.
PAGES = {
    "docs/getting-started.md": "import rich, matplotlib, shardscale.cli, shardscale.clip, "
    "shardscale.fsdp, shardscale.telemetry",
    "docs/accelerate.md": "import accelerate, shardscale.accelerate",
    "docs/lightning.md": "import lightning, shardscale.lightning",
    "docs/transformers.md": "import transformers, shardscale.transformers",
    "docs/torchtitan.md": "import shardscale.torchtitan",
    "docs/telemetry.md": "import shardscale.telemetry",
}
_FENCE = re.compile(r"^ *(`{3,}|~{3,})\s*(?P<info>\S*)")
_SHELL = {"bash", "console", "sh", "shell", "shell-session"}
_PIP_INSTALL = re.compile(r"(^|\s|/)pip3?\s+install\s|-m\s+pip\s+install\s")


def first_install_command(markdown: str) -> str:
    """The first shell-block line of ``markdown`` with a ``pip install`` (prompt stripped)."""
    in_shell, fence = False, ""
    pending = ""
    for raw in markdown.splitlines():
        m = _FENCE.match(raw)
        if m and not fence:
            fence, in_shell = m.group(1), m.group("info").lower() in _SHELL
            continue
        if m and fence and raw.strip().startswith(fence):
            fence, in_shell = "", False
            continue
        if not in_shell:
            continue
        line = raw.strip().removeprefix("$ ")
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if _PIP_INSTALL.search(line):
            return line
    raise AssertionError("no 'pip install' line in a bash/console block")


def pip_install_args(command: str) -> list[str]:
    """The arguments after ``pip install`` in the ``&&``-chain ``command``'s pip segment."""
    for segment in command.split("&&"):
        words = shlex.split(segment, comments=True)
        for i, word in enumerate(words[:-1]):
            if (word.endswith("pip") or word.endswith("pip3") or word == "pip") and words[
                i + 1
            ] == "install":
                return words[i + 2 :]
    raise AssertionError(f"no pip install in {command!r}")


def test_parser_reads_what_a_person_would_copy() -> None:
    text = "x\n```bash\n# a comment\n$ python3 -m venv .venv && .venv/bin/pip install a './b[ui]' \\\n  c && run\n```\n"
    command = first_install_command(text)
    assert command == "python3 -m venv .venv && .venv/bin/pip install a './b[ui]'  c && run"
    assert pip_install_args(command) == ["a", "./b[ui]", "c"]
    with pytest.raises(AssertionError, match="no 'pip install'"):
        first_install_command("```python\nos.system('pip install x')\n```\n")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _torch_closure() -> list[metadata.Distribution]:
    """torch and every distribution it requires (transitively) that is installed here."""
    seen: dict[str, metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        seen[name] = dist
        for req in dist.requires or []:
            if "extra ==" not in req:
                m = re.match(r"[A-Za-z0-9._-]+", req)
                if m:
                    todo.append(m.group(0))
    return list(seen.values())


def _place(dists: list[metadata.Distribution], site: Path) -> None:
    """Hard-link (else copy) each distribution's files into ``site`` (see [Note: torch ...])."""
    for dist in dists:
        base = Path(str(dist.locate_file(""))).resolve()
        for entry in dist.files or []:
            src = Path(str(dist.locate_file(entry))).resolve()
            try:
                rel = src.relative_to(base)
            except ValueError:
                continue  # scripts outside site-packages (bin/torchrun): not needed here
            if not src.is_file():
                continue
            dst = site / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


def _constraints(path: Path) -> Path:
    """``noxfile.py``'s FRAMEWORKS pins as a pip constraints file."""
    tree = ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))
    pins: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "FRAMEWORKS" for t in node.targets
        ):
            pins = list(ast.literal_eval(node.value))
    assert pins, "noxfile.py has no FRAMEWORKS list"
    path.write_text("\n".join(pins) + "\n", encoding="utf-8")
    return path


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{shlex.join(cmd)} (in {cwd}) failed:\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def _check_page(page: str, clone: Path, work: Path, env: dict[str, str]) -> str:
    command = first_install_command((clone / page).read_text(encoding="utf-8"))
    venv = work / Path(page).stem
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=clone, env=env, timeout=60).strip())  # fmt: skip
    _place(_torch_closure(), site)
    args = pip_install_args(command)
    _run([str(python), "-m", "pip", "install", "--quiet", *args], cwd=clone, env=env, timeout=900)
    _run([str(python), "-m", "pip", "check"], cwd=clone, env=env, timeout=120)
    _run([str(python), "-c", PAGES[page]], cwd=work, env=env, timeout=300)
    if page == "docs/getting-started.md":
        version = _run([str(venv / "bin" / "shardscale"), "--version"], cwd=work, env=env,
                       timeout=120)  # fmt: skip
        assert version.startswith("shardscale "), version
    return command


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_first_install_command_of_each_page_works_from_a_fresh_clone(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing to clone")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PIP_CONSTRAINT=str(_constraints(tmp_path / "constraints.txt")),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        HF_HUB_OFFLINE="1",
    )
    # Two pages at a time: most of the time is pip waiting on builds and the disk.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {page: pool.submit(_check_page, page, clone, tmp_path, env) for page in PAGES}
        commands = {page: f.result() for page, f in futures.items()}
    # The README's newcomer line is getting-started's, word for word.
    readme = first_install_command((clone / "README.md").read_text(encoding="utf-8"))
    assert readme == commands["docs/getting-started.md"]
