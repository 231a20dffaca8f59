"""The collator against label building of the kind TRL does today, on the same batch, same run.

Baseline: TRL's ``DataCollatorForLanguageModeling`` pads the batch, then labels are built the way
completion-only collators have done it (a Python loop over every token of every row, comparing the
response / instruction templates there). Ours: ``CompletionCollator`` (pad + engine labels in torch).
Both produce the same labels (checked). ``speedup`` > 1 means the collator is faster.

Run: ``pytest benchmarks/bench_collator.py --benchmark-enable -s``.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHATML, best_seconds, chatml_rows

torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")

BATCH = 16  # rows of ~1,000 tokens: a typical micro-batch


def python_loop_labels(batch, markers):
    """Completion-only labels with a per-token Python loop (how TRL-style collators build them)."""
    labels = batch["labels"].clone()
    response, closers, ends = markers.response, markers.response + markers.instruction, markers.end
    for r in range(labels.shape[0]):
        row = batch["input_ids"][r].tolist()
        n = int(batch["attention_mask"][r].sum())
        inside, pending_open = False, []
        for i in range(n):
            if i in pending_open:
                inside = True
            for p in closers:
                if row[i : i + len(p)] == list(p):
                    inside = False
            for p in response:
                if row[i : i + len(p)] == list(p):
                    pending_open.append(i + len(p))
            if i in pending_open and any(row[i - len(p) : i] == list(p) for p in response):
                inside = True
            if not inside:
                labels[r, i] = -100
            for p in ends:
                if i + 1 >= len(p) and row[i + 1 - len(p) : i + 1] == list(p):
                    inside = False
        labels[r, n:] = -100
    return labels


def trl_baseline(examples, markers):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0)(examples)
    batch["labels"] = python_loop_labels(batch, markers)
    return batch


@pytest.fixture(scope="module")
def examples():
    rows = chatml_rows(BATCH, seed=3)
    return [{"input_ids": r} for r in rows.to_pylist()]


@pytest.fixture(params=[1, None], ids=["1-thread", "default-threads"])
def threads(request):
    """1 thread is what a DataLoader worker process runs with; the default is the trainer's main process."""
    before = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def test_collator_vs_python_loop(benchmark, examples, threads):
    from lossmask.collator import CompletionCollator

    collate = CompletionCollator(markers=CHATML, pad_token_id=0)
    ours = collate(examples)
    theirs = trl_baseline(examples, CHATML)
    assert torch.equal(ours["labels"], theirs["labels"]) and torch.equal(ours["input_ids"], theirs["input_ids"])
    n_tokens = int(ours["attention_mask"].sum())
    baseline = best_seconds(lambda: trl_baseline(examples, CHATML), repeat=3)
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    pad_only = best_seconds(lambda: DataCollatorForLanguageModeling(pad_token_id=0)(examples), repeat=5)
    benchmark.pedantic(collate, args=(examples,), rounds=10, warmup_rounds=1)
    seconds = benchmark.stats.stats.min
    benchmark.extra_info.update(speedup=baseline / seconds, ms=seconds * 1e3, baseline_ms=baseline * 1e3,
                                trl_pad_only_ms=pad_only * 1e3)
    print(f"\n[torch threads: {threads}] collator on {BATCH} rows / {n_tokens:,} tokens: {seconds * 1e3:.1f} ms; TRL pad + per-token Python "
          f"labels {baseline * 1e3:.1f} ms; speedup {baseline / seconds:.0f}x "
          f"(TRL pad only, labels precomputed: {pad_only * 1e3:.1f} ms)")
