"""The collator against label building of the kind TRL does today, on the same batch, same run.

Baseline: TRL's ``DataCollatorForLanguageModeling`` pads the batch, then labels are built the way
completion-only collators have done it (a Python loop over every token of every row, comparing the
response / instruction templates there). Ours: ``CompletionCollator`` (pad + engine labels in torch).
Both produce the same labels (checked). ``speedup`` > 1 means the collator is faster.

Run: ``pytest benchmarks/bench_collator.py --benchmark-enable -s``.
"""

from __future__ import annotations

import time

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


@pytest.mark.parametrize("share", ["all", "half"], ids=["all-rows-weighted", "half-the-rows-weighted"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_collator_with_loss_weights_vs_without(benchmark, examples, padding_free, share):
    """Rows that carry ``loss_weights`` (Python float lists, as a datasets row gives them) against
    the same rows without them, same collator settings, same run; ``ratio`` = with / without.

    When every row brings its weights the labels follow them and the markers are not run; when only
    some do, the batch is labelled by the markers and the weighted rows' labels and weights replace theirs."""
    import lossmask
    from lossmask.collator import CompletionCollator

    labels = lossmask.make_labels([e["input_ids"] for e in examples], CHATML)
    weighted = [{"input_ids": e["input_ids"], "loss_weights": [0.5 if x != -100 else 0.0 for x in row]}
                if share == "all" or i % 2 == 0 else e for i, (e, row) in enumerate(zip(examples, labels))]
    collate = CompletionCollator(markers=CHATML, pad_token_id=0, padding_free=padding_free)
    assert "loss_weights" in collate(weighted) and "loss_weights" not in collate(examples)
    assert torch.equal(collate(weighted)["labels"], collate(examples)["labels"])  # weights > 0 exactly on trained tokens
    n_tokens = sum(len(e["input_ids"]) for e in examples)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker's setting; one thread, so its CPU time is the whole cost
    try:
        # CPU time of this thread (best of 30, interleaved): steadier than the wall clock on a shared machine
        cpu_with = cpu_without = float("inf")
        for _ in range(30):
            cpu_without = min(cpu_without, best_seconds(lambda: collate(examples), repeat=1, clock=time.thread_time))
            cpu_with = min(cpu_with, best_seconds(lambda: collate(weighted), repeat=1, clock=time.thread_time))
        without = best_seconds(lambda: collate(examples), repeat=10)
        benchmark.pedantic(collate, args=(weighted,), rounds=10, warmup_rounds=1)
    finally:
        torch.set_num_threads(before)
    seconds = benchmark.stats.stats.min
    benchmark.extra_info.update(ratio=seconds / without, ms=seconds * 1e3, without_ms=without * 1e3,
                                cpu_ratio=cpu_with / cpu_without)
    print(f"\n[{'padding-free' if padding_free else 'padded'}, {share} rows weighted] collator on {BATCH} rows / "
          f"{n_tokens:,} tokens, 1 torch thread: with loss_weights {seconds * 1e3:.2f} ms, without {without * 1e3:.2f} ms "
          f"(wall, ratio {seconds / without:.2f}x); CPU time {cpu_with * 1e3:.2f} / {cpu_without * 1e3:.2f} ms, "
          f"ratio {cpu_with / cpu_without:.2f}x")


@pytest.mark.parametrize("per_sequence", [False, True], ids=["per-token", "per-sequence"])
def test_weighted_loss_vs_cross_entropy(benchmark, per_sequence):
    """``weighted_cross_entropy`` against the mean cross-entropy over labels (what the model's own
    loss computes), forward and backward, same logits, same run; ``ratio`` = weighted / plain."""
    from lossmask.collator import weighted_cross_entropy

    torch.manual_seed(0)
    rows, width, vocab = 4, 512, 8192
    logits = torch.randn(rows, width, vocab, requires_grad=True)
    ids = torch.randint(0, vocab, (rows, width))
    weights = torch.where(torch.rand(rows, width) < 0.6, torch.rand(rows, width) * 2, 0.0)
    labels = torch.where(weights > 0, ids, -100)

    def plain():
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
        loss.backward()

    def weighted():
        weighted_cross_entropy(logits, ids, weights, per_sequence=per_sequence).backward()

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu_plain = cpu_weighted = float("inf")
        for _ in range(5):
            cpu_plain = min(cpu_plain, best_seconds(plain, repeat=1, clock=time.thread_time))
            cpu_weighted = min(cpu_weighted, best_seconds(weighted, repeat=1, clock=time.thread_time))
        benchmark.pedantic(weighted, rounds=3, warmup_rounds=1)
    finally:
        torch.set_num_threads(before)
    benchmark.extra_info.update(cpu_ratio=cpu_weighted / cpu_plain, cpu_ms=cpu_weighted * 1e3, cpu_plain_ms=cpu_plain * 1e3)
    print(f"\n[{'per sequence' if per_sequence else 'per token'}] loss + backward on [{rows}, {width}, {vocab}] logits, 1 torch "
          f"thread: weighted {cpu_weighted * 1e3:.1f} ms CPU, plain mean over labels {cpu_plain * 1e3:.1f} ms; "
          f"ratio {cpu_weighted / cpu_plain:.2f}x")
