"""The engine on 20 M tokens of ChatML-like rows, as a ratio to np.copyto of the same tokens.

Run: ``make bench`` (or ``pytest benchmarks/bench_engine.py --benchmark-enable -s``).
"""

from __future__ import annotations

import numpy as np
import pytest

import lossmask
from conftest import CHATML, chatml_rows, copy_baseline_seconds

N_ROWS = 20_000  # x ~1,000 tokens = ~20 M tokens


@pytest.fixture(scope="module")
def rows():
    arr = chatml_rows(N_ROWS)
    lossmask.make_labels(arr.slice(0, 10), CHATML)  # compile (or load the cache) outside the timing
    return arr


@pytest.fixture(scope="module")
def n_tokens(rows):
    return len(rows.values)


def report(benchmark, name, n_tokens, baseline_seconds, dtype_name="int64"):
    seconds = benchmark.stats.stats.min
    ratio = baseline_seconds / seconds
    benchmark.extra_info.update(
        mtok_per_s=n_tokens / seconds / 1e6, copy_mtok_per_s=n_tokens / baseline_seconds / 1e6, ratio_to_copy=ratio
    )
    print(
        f"\n{name}: {n_tokens / 1e6:.1f} M tokens, {n_tokens / seconds / 1e6:,.0f} Mtok/s; "
        f"np.copyto int32->{dtype_name} {n_tokens / baseline_seconds / 1e6:,.0f} Mtok/s; ratio {ratio:.2f}x"
    )


@pytest.mark.parametrize("dtype", ["int64", "int32"])
def test_make_labels_numba(benchmark, rows, n_tokens, dtype):
    baseline = copy_baseline_seconds(rows.values.to_numpy(), np.dtype(dtype))
    benchmark.pedantic(lossmask.make_labels, args=(rows, CHATML), kwargs=dict(dtype=dtype), rounds=7, warmup_rounds=1)
    report(benchmark, f"make_labels numba -> {dtype}", n_tokens, baseline, dtype)


def test_label_batch_last_turn_only_numba(benchmark, rows, n_tokens):
    baseline = copy_baseline_seconds(rows.values.to_numpy())
    benchmark.pedantic(lossmask.label_batch, args=(rows, CHATML), kwargs=dict(last_turn_only=True), rounds=5)
    report(benchmark, "label_batch numba, last_turn_only", n_tokens, baseline)


def test_make_labels_numpy_reference(benchmark, rows):
    subset = rows.slice(0, 2_000)  # the reference loops over rows in Python: a tenth of the data
    n = subset.offsets[-1].as_py() - subset.offsets[0].as_py()
    baseline = copy_baseline_seconds(subset.flatten().to_numpy())
    benchmark.pedantic(lossmask.make_labels, args=(subset, CHATML), kwargs=dict(backend="numpy"), rounds=1)
    report(benchmark, "make_labels numpy reference (2,000 rows)", n, baseline)
