"""Every Python code block in the docs and READMEs runs, so no snippet can teach something wrong.

The ``<!-- run: ... -->`` markers that say how a block runs (python, torchrun N, cuda, no)
are defined for contributors in ``docs/contributing.md``; ``parse_marker`` is their grammar.

[Note: why every docs block runs in a process of its own]
Snippets initialise process groups, Accelerate's singletons, telemetry sessions and seeds;
none of that may leak into the next block, and in-process ``exec`` would also share this
pytest process's imports, warnings filters and environment with the reader's code. So each
block is a script run by a fresh interpreter (two at a time, see ``_Launches``), padded so
that its line N is line N of its Markdown file: a traceback points at the docs line. The cost
is one torch import per block (about 3 s of CPU with the optimizer's first use), about 100 s
of CPU for the whole module, so about 50 s on an idle 2-core machine.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SETUP_DIR = ROOT / "docs" / "snippets"
#: The files whose Python blocks must run (the READMEs PyPI shows, and every docs page).
DOC_GLOBS = ("README.md", "docs/**/*.md", "packages/*/README.md")
#: Seconds one block may take (a single-process block takes 2-10 s on a shared 2-core machine;
#: a launch of 2 ranks about 10 s): past this it is a hang, not slowness.
TIMEOUT_S = 150

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,}|:{3,})\s*(?P<info>[^`]*)$")
_PYTHON_INFO = re.compile(r"^(python3?|py|\{code-block\}\s+python3?|\{code\}\s+python3?)\b")
_MARKER = re.compile(r"^\s*<!--\s*run:(?P<body>.*?)-->\s*$")
_SPEC = re.compile(
    r"^(?P<mode>python|cuda|no|torchrun\s+(?P<ranks>\d+))"
    r"(?:\s+with\s+(?P<setup>[\w.-]+\.py))?"
    r"(?:\s*,\s*because(?:\s+(?P<reason>.*\S))?)?$"
)


class MarkerError(ValueError):
    """A ``<!-- run: ... -->`` comment that does not follow the convention."""


@dataclass(frozen=True)
class Snippet:
    """One fenced Python block and how its marker says to run it."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    marker: str | None  # the comment's body, None without a comment

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"


@dataclass(frozen=True)
class RunSpec:
    """What a marker means: ``mode`` is python, cuda, no or torchrun."""

    mode: str
    ranks: int = 1
    setup: str | None = None
    reason: str | None = None


def parse_marker(body: str | None) -> RunSpec:
    """The run spec of a marker's body (``None``: no marker, run with python)."""
    if body is None:
        return RunSpec("python")
    text = " ".join(body.split())
    m = _SPEC.match(text)
    if m is None:
        raise MarkerError(
            f"unknown run marker {text!r}; write one of 'python', 'torchrun N', "
            "'cuda, because REASON' or 'no, because REASON' (optionally 'with NAME.py' after "
            "python/torchrun)"
        )
    mode = "torchrun" if m["ranks"] else m["mode"]
    reason, setup = m["reason"], m["setup"]
    if mode in ("no", "cuda") and not reason:
        raise MarkerError(f"'run: {mode}' needs a reason: '<!-- run: {mode}, because ... -->'")
    if mode in ("python", "torchrun") and reason:
        raise MarkerError(f"'run: {text}': a block that runs takes no reason; drop 'because'")
    if setup is not None and mode not in ("python", "torchrun"):
        raise MarkerError(f"'run: {text}': only python and torchrun blocks take a setup file")
    if setup is not None and not (SETUP_DIR / setup).is_file():
        raise MarkerError(f"'run: {text}': no setup file docs/snippets/{setup}")
    ranks = int(m["ranks"]) if m["ranks"] else 1
    if mode == "torchrun" and ranks < 2:
        raise MarkerError(f"'run: {text}': torchrun needs 2 ranks or more; use 'python'")
    return RunSpec(mode, ranks=ranks, setup=setup, reason=reason)


def extract(path: Path, text: str | None = None) -> tuple[list[Snippet], list[int]]:
    """The Python blocks of one Markdown file, and the lines of markers that precede no block."""
    lines = (path.read_text(encoding="utf-8") if text is None else text).splitlines()
    snippets: list[Snippet] = []
    orphans: list[int] = []
    i = 0
    while i < len(lines):
        if _MARKER.match(lines[i]) and not (
            i + 1 < len(lines)
            and (f := _FENCE.match(lines[i + 1]))
            and _PYTHON_INFO.match(f["info"].strip())
        ):
            orphans.append(i + 1)
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        end = i + 1
        while end < len(lines) and not re.match(
            rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]
        ):
            end += 1
        if _PYTHON_INFO.match(opening["info"].strip()):
            marker = _MARKER.match(lines[i - 1]) if i > 0 else None
            body = [ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1 : end]]
            snippets.append(
                Snippet(path, i + 1, "\n".join(body) + "\n", marker["body"] if marker else None)
            )
        i = end + 1
    return snippets, orphans


def doc_files() -> list[Path]:
    """Every Markdown file whose Python blocks are checked, in a stable order."""
    return sorted({p for pattern in DOC_GLOBS for p in ROOT.glob(pattern)})


def all_snippets() -> list[Snippet]:
    return [s for path in doc_files() for s in extract(path)[0]]


def script_text(snippet: Snippet, spec: RunSpec) -> str:
    """The block as a script whose line N is line N of its Markdown file."""
    head = [f"from {spec.setup[:-3]} import *  # docs/snippets/{spec.setup}" if spec.setup else ""]
    head += [""] * (snippet.line - 1)
    return "\n".join(head) + "\n" + snippet.code


def _env() -> dict[str, str]:
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "SHARDSCALE_BACKEND", "SHARDSCALE_TELEMETRY"}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in drop}
    path = [str(SETUP_DIR), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), OMP_NUM_THREADS="1")
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    return env


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    # A session of its own, so that a hung block is stopped with everything it started: torchrun
    # starts each worker in a session of its own too, and stops them when it gets SIGTERM.
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return -1, out.decode(errors="replace") + f"\n[stopped after {TIMEOUT_S} s]"
    return proc.returncode, out.decode(errors="replace")


def _command(snippet: Snippet, spec: RunSpec, folder: Path) -> list[str]:
    name = snippet.id.replace("/", "_").replace(":", "_L").replace(".md", "") + ".py"
    script = folder / name
    script.write_text(script_text(snippet, spec), encoding="utf-8")
    if spec.mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(spec.ranks), str(script)]  # fmt: skip
    return [sys.executable, str(script)]


def _should_run(spec: RunSpec) -> bool:
    return spec.mode in ("python", "torchrun") or (
        spec.mode == "cuda" and torch.cuda.is_available()
    )


class _Launches:
    """Runs the selected blocks two at a time, in the order pytest will ask for them.

    Most of a block's time is one interpreter importing torch, single-threaded: two at a time
    keep both cores of a CI machine busy, so the module costs about half its serial time.
    """

    JOBS = 2

    def __init__(self, snippets: list[Snippet], folder: Path) -> None:
        self._pool = ThreadPoolExecutor(max_workers=self.JOBS)
        self._jobs: dict[str, Future[tuple[int, str]]] = {}
        for i, snippet in enumerate(snippets):
            try:
                spec = parse_marker(snippet.marker)
            except MarkerError:
                continue  # its test case reports the marker
            if _should_run(spec):
                work = folder / f"block{i}"
                work.mkdir()
                self._jobs[snippet.id] = self._pool.submit(
                    _run, _command(snippet, spec, work), work
                )

    def result(self, snippet: Snippet) -> tuple[int, str]:
        return self._jobs[snippet.id].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


SNIPPETS = all_snippets()


@pytest.fixture(scope="module")
def launches(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Launches]:
    # Only the blocks this session selected (-k), in the order their cases run.
    selected = [item.callspec.params["snippet"] for item in request.session.items
                if isinstance(item, pytest.Function) and item.module is request.module
                and item.originalname == "test_docs_python_block_runs"]  # fmt: skip
    runner = _Launches(selected, tmp_path_factory.mktemp("docs-snippets"))
    try:
        yield runner
    finally:
        runner.close()


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_docs_python_block_runs(snippet: Snippet, launches: _Launches) -> None:
    spec = parse_marker(snippet.marker)
    if spec.mode == "no":
        pytest.skip(f"not run: {spec.reason}")
    if not _should_run(spec):
        pytest.skip(f"needs CUDA: {spec.reason}")
    rc, out = launches.result(snippet)
    assert rc == 0, f"{snippet.id} ({spec.mode}) exited with {rc}:\n{out[-6000:]}"


def test_every_run_marker_precedes_a_python_block() -> None:
    orphans = [f"{p.relative_to(ROOT)}:{n}" for p in doc_files() for n in extract(p)[1]]
    assert not orphans, f"run markers not directly above a ```python fence: {orphans}"


def test_no_markdown_file_with_python_is_left_out() -> None:
    # A new page or package README must not escape the globs above.
    skip = {".git", ".nox", "_build", "node_modules", "build", "dist"}
    pages = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]
        pages += [Path(folder) / f for f in files if f.endswith(".md")]
    left_out = sorted(
        p.relative_to(ROOT).as_posix() for p in set(pages) - set(doc_files()) if extract(p)[0]
    )
    assert not left_out, f"Markdown files with Python blocks that no glob reads: {left_out}"
    assert ROOT / "docs" / "pipeline.md" in {s.path for s in SNIPPETS}


MARKDOWN = """\
Text.

<!-- run: no -->
```python
fragment(...)
```

<!-- run: cuda, because -->
```python
x = 1
```

<!-- run: torchrun 4, because it is nice -->
```python
x = 1
```

<!-- run: sometimes -->
```python
x = 1
```

<!-- run: no, because a sketch -->

```python
x = 1
```

   ```py
   indented = True
   ```
"""


def test_markers_are_checked() -> None:
    snippets, orphans = extract(ROOT / "x.md", MARKDOWN)
    assert [s.line for s in snippets] == [4, 9, 14, 19, 25, 29]
    assert orphans == [23]  # a blank line between marker and fence: the marker is not its own
    errors = []
    for s in snippets[:4]:
        with pytest.raises(MarkerError) as info:
            parse_marker(s.marker)
        errors.append(str(info.value))
    assert "needs a reason" in errors[0] and "needs a reason" in errors[1]
    assert "takes no reason" in errors[2] and "unknown run marker" in errors[3]
    assert snippets[4].marker is None and parse_marker(None) == RunSpec("python")
    assert snippets[5].code == "indented = True\n"
    assert parse_marker(" torchrun 4 ") == RunSpec("torchrun", ranks=4)
    assert parse_marker("no, because it is a sketch") == RunSpec("no", reason="it is a sketch")
    script = script_text(snippets[5], RunSpec("python")).splitlines()
    assert script[29] == "indented = True"  # line 30 of the script is line 30 of the file
