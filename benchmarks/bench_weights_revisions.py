"""What weights cost at two revisions of lossmask, measured in alternating processes: did a change help?

    python benchmarks/bench_weights_revisions.py REV [--rounds 4] [--jobs 2] [--rows 20000] [--tokenizer DIR]

On the 2-core VM the weights' cost (``bench_weights.py``) moves by +-0.05 from one run to the next, more than most
single changes gain or lose. So the two revisions take turns: ``--rounds`` times, one process runs the code of
``REV`` (checked out into a temporary git worktree, imported ahead of the installed package), then one the working
tree's (in reverse order every other round). Each process times ``mask_files`` on the same 20,000 generated chats
(``bench_weights.write_input``): labels alone, ``roles_to_train`` user+assistant and the message fields, ``--jobs``
rounds of each in alternating order, and gives each weighed job's ratio to the labels of its own round. Prints each
process's median ratios, then every revision's median over all of its rounds, and the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CONFIGS = ("labels", "roles", "message fields")


def child(args: argparse.Namespace) -> None:
    """One process: the jobs of one revision (the ``lossmask`` that ``sys.path`` finds first)."""
    sys.path.insert(0, str(HERE))
    import lossmask
    from bench_weights import CONFIGS as FIELDS

    tok = lossmask.load_tokenizer(args.tokenizer)
    out = os.path.join(args.data, "out.parquet")
    for name in CONFIGS:  # compile and load everything once, untimed
        lossmask.mask_files(os.path.join(args.data, "warm.parquet"), out, tokenizer=tok, progress=False,
                            max_drop_fraction=1.0, **FIELDS[name])
    seconds: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for round_ in range(args.jobs):
        for name in CONFIGS if round_ % 2 == 0 else CONFIGS[::-1]:
            started = time.perf_counter()
            lossmask.mask_files(os.path.join(args.data, "chats.parquet"), out, tokenizer=tok, progress=False,
                                max_drop_fraction=1.0, **FIELDS[name])
            seconds[name].append(time.perf_counter() - started)
    print(json.dumps({"file": lossmask.__file__, "seconds": seconds}))


def worktree(revision: str, into: Path) -> Path:
    """``revision`` checked out at ``into/tree``; returns a folder to put first on ``PYTHONPATH`` so that its
    ``lossmask`` (with its ``kernels/`` as ``lossmask.engine.kernels``, as setup.py maps them) is the one imported."""
    tree = into / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), revision], check=True)
    site = into / "site"
    site.mkdir()
    (site / "lossmask").symlink_to(tree / "src" / "lossmask")
    (tree / "src" / "lossmask" / "engine" / "kernels").symlink_to(tree / "kernels")
    return site


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", nargs="?")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "tokenizers" / "qwen2.5"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if not args.revision:
        parser.error("name the revision to compare the working tree with (a commit, a tag, HEAD~3)")
    sys.path.insert(0, str(HERE))
    from bench_weights import write_input

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        write_input(str(tmp_path / "chats.parquet"), args.rows)
        write_input(str(tmp_path / "warm.parquet"), 300)
        site = worktree(args.revision, tmp_path)
        try:
            env = {"old": dict(os.environ, PYTHONPATH=str(site)), "new": dict(os.environ, PYTHONPATH="")}
            command = [sys.executable, __file__, "--child", "--data", tmp, "--jobs", str(args.jobs),
                       "--tokenizer", args.tokenizer]
            ratios: dict[str, dict[str, list[float]]] = {v: {name: [] for name in CONFIGS} for v in env}
            load_before = os.getloadavg()[0]
            for round_ in range(args.rounds):
                for version in ("old", "new") if round_ % 2 == 0 else ("new", "old"):
                    done = subprocess.run(command, env=env[version], cwd=tmp, capture_output=True, text=True,
                                          check=True)
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                    seconds = result["seconds"]
                    mine = {name: [a / b for a, b in zip(seconds[name], seconds["labels"])] for name in CONFIGS}
                    for name in CONFIGS:
                        ratios[version][name] += mine[name]
                    print(f"{version} ({result['file']}): "
                          + ", ".join(f"{name} {statistics.median(mine[name]):.3f}x" for name in CONFIGS[1:])
                          + f"; labels {', '.join(f'{s:.2f}' for s in seconds['labels'])} s", flush=True)
            load_after = os.getloadavg()[0]
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tmp_path / "tree")],
                           check=False)
    print(f"\n{args.rows:,} chats, {args.rounds} rounds of {args.jobs} jobs each; load average {load_before:.2f} "
          f"before, {load_after:.2f} after ({os.cpu_count()} cores)\n")
    print("| revision | " + " | ".join(CONFIGS[1:]) + " |")
    print("| --- | " + " | ".join("---:" for _ in CONFIGS[1:]) + " |")
    for version, name in (("old", args.revision), ("new", "working tree")):
        print(f"| {name} | " + " | ".join(f"{statistics.median(ratios[version][c]):.3f}x" for c in CONFIGS[1:])
              + " |")


if __name__ == "__main__":
    main()
