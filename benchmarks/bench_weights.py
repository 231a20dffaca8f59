"""What weights cost: ``mask_files`` on realistic chats, labels alone against each kind of weight, one run.

    python benchmarks/bench_weights.py [--rows 20000] [--repeat 3] [--tokenizer DIR] [--batches]

The input is ``realistic_chats`` (multi-turn, ~4,000 characters a chat) with two additions real mixtures carry: an
OpenAI ``weight`` on a quarter of the assistant messages (0 or 1; the rest have none) and a ``dataset`` column.
Every configuration reads the same Parquet file and writes Parquet, end to end, so each ratio is the whole job's:

- ``labels``: the markers alone (``weight_field=None``: the field is not read) -- the baseline;
- ``message fields``: the ``weight`` field read (rows whose turns differ are placed by character offsets);
- ``prompt weight``: ``prompt_weight=0.05`` (every row, token level, a ``loss_weights`` column written);
- ``roles``: ``roles_to_train=["user", "assistant"]`` (every row placed by character offsets);
- ``source column``: the report's tokens and weight mass per ``dataset``.

``--batches`` times ``mask_batch`` on the rows in memory instead (batches of 4,000 rows, no Parquet read or write):
the labelling step alone, where the weights' share is largest.

Configurations run interleaved, ``--repeat`` rounds, in reverse order every other round. Two figures per
configuration: the best wall and CPU time (every thread) with their ratios to the baseline's best, and the median
over the rounds of each round's ratio to the baseline of the same round. On a machine whose speed drifts by more
than the weights cost (the 2-core VM: the same job took 2.5 s and 4.0 s an hour apart) the paired median is the
steadier one. Prints a Markdown table and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CONFIGS = {
    "labels": dict(weight_field=None),
    "message fields": dict(),
    "prompt weight": dict(weight_field=None, prompt_weight=0.05),
    "roles": dict(weight_field=None, roles_to_train=["user", "assistant"]),
    "source column": dict(weight_field=None, source_column="dataset"),
}


def write_input(path: str, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from realistic_chats import chats

    rng = random.Random(1)
    data = chats(rows)
    for messages in data:
        for message in messages:
            if message["role"] == "assistant" and rng.random() < 0.25:
                message["weight"] = rng.choice((0, 1))
    names = [rng.choice(("code", "chat", "math")) for _ in data]
    pq.write_table(pa.table({"messages": data, "dataset": names}), path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokenizer", default=str(HERE.parent.parent / "shared" / "tokenizers" / "qwen2.5"))
    parser.add_argument("--batches", action="store_true", help="time mask_batch in memory, not mask_files")
    args = parser.parse_args()
    import lossmask

    tok = lossmask.load_tokenizer(args.tokenizer)
    load_before = os.getloadavg()
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "chats.parquet")
        write_input(source, args.rows)
        warm = os.path.join(tmp, "warm.parquet")
        write_input(warm, 300)
        table = _read(source) if args.batches else None
        for k, fields in enumerate(CONFIGS.values()):  # compile, load and prove everything once, untimed
            if args.batches:
                _in_memory(_read(warm), tok, None, **fields)
            else:
                lossmask.mask_files(warm, os.path.join(tmp, f"warm-{k}.parquet"), tokenizer=tok, progress=False,
                                    max_drop_fraction=1.0, **fields)
        for round_ in range(args.repeat):
            order = list(CONFIGS.items()) if round_ % 2 == 0 else list(CONFIGS.items())[::-1]
            for name, fields in order:
                out = os.path.join(tmp, f"out-{round_}-{name.replace(' ', '-')}.parquet")
                started, cpu = time.perf_counter(), _cpu()
                if args.batches:
                    reports[name] = _in_memory(table, tok, out, **fields)
                else:
                    reports[name] = lossmask.mask_files(source, out, tokenizer=tok, progress=False,
                                                        max_drop_fraction=1.0, **fields)
                seconds, cpu = time.perf_counter() - started, _cpu() - cpu
                best[name] = min(best.get(name, float("inf")), seconds)
                best_cpu[name] = min(best_cpu.get(name, float("inf")), cpu)
                rounds[name].append((seconds, cpu))
                if os.path.exists(out):
                    os.remove(out)
                print(f"round {round_}: {name}: {seconds:.2f} s, {cpu:.2f} CPU s", file=sys.stderr)
    load_after = os.getloadavg()
    base = best["labels"]
    tokens = reports["labels"].tokens_in
    what = "mask_batch in memory" if args.batches else "mask_files, Parquet to Parquet"
    print(f"{args.rows:,} chats, {tokens:,} tokens, {Path(args.tokenizer).name}, {what}, best of {args.repeat}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} cores)\n")
    print("| configuration | wall s (best) | ratio | CPU s (best) | ratio | paired median ratio, wall | CPU | "
          "trained tokens | weights stage (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in CONFIGS:
        report = reports[name]
        wall = statistics.median(a[0] / b[0] for a, b in zip(rounds[name], rounds["labels"]))
        cpu = statistics.median(a[1] / b[1] for a, b in zip(rounds[name], rounds["labels"]))
        print(f"| {name} | {best[name]:.2f} | {best[name] / base:.3f}x | {best_cpu[name]:.2f} | "
              f"{best_cpu[name] / best_cpu['labels']:.3f}x | {wall:.3f}x | {cpu:.3f}x | {report.tokens_trained:,} | "
              f"{report.seconds.get('weights', 0.0):.2f} |")


def _read(path: str):
    import pyarrow.parquet as pq

    return pq.read_table(path)


def _in_memory(table, tok, out, **fields):
    """``mask_batch`` over ``table`` in batches of 4,000 rows; the report of the whole."""
    from lossmask import MaskOptions
    from lossmask.engine.tally import Tally
    from lossmask.jobs.batch_step import mask_batch
    from lossmask.jobs.report import MaskReport

    markers = _markers(tok)
    options = MaskOptions(max_drop_fraction=1.0, **fields)
    tally = Tally()
    for start in range(0, table.num_rows, 4_000):
        mask_batch(table.slice(start, 4_000), markers, options, tally, tokenizer=tok, first_row=start)
    return MaskReport.build(tally, markers=markers, markers_source="detected", keep_dropped=False)


_MARKERS = {}


def _markers(tok):
    import lossmask

    if id(tok) not in _MARKERS:
        _MARKERS[id(tok)] = lossmask.detect_markers(tok)
    return _MARKERS[id(tok)]


def _cpu() -> float:
    """CPU seconds of this process, every thread (the Rust tokeniser's pool included): steadier than wall time on a
    shared machine."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
