"""The torch and MLX backends on the CPU, as throughput ratios to the numba engine on the same rows.

Run: ``pytest benchmarks/bench_backends.py --benchmark-enable -s``. ``ratio_to_numba`` > 1 means faster
than numba. Both array backends do several whole-buffer passes per pattern where numba does one scan,
so on a CPU they are expected to be slower; they exist to label where the tensors already are (a CUDA
batch in the collator, an MLX batch in the MLX-LM feed).
"""

from __future__ import annotations

import numpy as np
import pytest

import lossmask
from conftest import CHATML, best_seconds, chatml_rows

N_ROWS = 2_000  # x ~1,000 tokens = ~2 M tokens


@pytest.fixture(scope="module")
def rows():
    arr = chatml_rows(N_ROWS)
    lossmask.make_labels(arr.slice(0, 10), CHATML)  # compile numba outside the timing
    return arr


@pytest.fixture(scope="module")
def numba_seconds(rows):
    return best_seconds(lambda: lossmask.make_labels(rows, CHATML))


def report(benchmark, name, n_tokens, numba_seconds):
    seconds = benchmark.stats.stats.min
    ratio = numba_seconds / seconds
    benchmark.extra_info.update(mtok_per_s=n_tokens / seconds / 1e6, numba_mtok_per_s=n_tokens / numba_seconds / 1e6,
                                ratio_to_numba=ratio)
    print(f"\n{name}: {n_tokens / 1e6:.1f} M tokens, {n_tokens / seconds / 1e6:,.1f} Mtok/s; "
          f"numba {n_tokens / numba_seconds / 1e6:,.1f} Mtok/s; ratio to numba {ratio:.3f}x")


@pytest.fixture
def torch_threads(request):
    """Run with ``torch.set_num_threads(request.param)`` (None: torch's default), restored after."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    if request.param:
        torch.set_num_threads(request.param)
    yield torch.get_num_threads()
    torch.set_num_threads(before)


@pytest.mark.parametrize("backend, torch_threads", [("torch", None), ("torch", 1), ("mlx", None)],
                         ids=["torch", "torch-1-thread", "mlx"], indirect=["torch_threads"])
def test_make_labels_backend(benchmark, rows, numba_seconds, backend, torch_threads):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    want = lossmask.make_labels(rows, CHATML)
    got = lossmask.make_labels(rows, CHATML, backend=backend)  # also warms up (MLX: eager, then compiled)
    assert got.equals(want)
    benchmark.pedantic(lossmask.make_labels, args=(rows, CHATML), kwargs=dict(backend=backend), rounds=3, warmup_rounds=1)
    threads = f", {torch_threads} torch threads" if backend == "torch" else ""
    report(benchmark, f"make_labels {backend} (CPU{threads})", len(rows.values), numba_seconds)


def test_torch_label_padded(benchmark, rows, numba_seconds):
    """The collator's path: a padded [B, T] tensor with lengths."""
    torch = pytest.importorskip("torch")
    from lossmask.engine.kernels import torch_kernel

    lengths = np.diff(rows.offsets.to_numpy())
    width = int(lengths.max())
    ids = np.zeros((len(rows), width), dtype=np.int64)
    values = rows.values.to_numpy()
    row = np.repeat(np.arange(len(rows)), lengths)
    col = np.arange(len(values)) - np.repeat(rows.offsets.to_numpy()[:-1], lengths)
    ids[row, col] = values
    ids_t, lengths_t = torch.from_numpy(ids), torch.from_numpy(lengths.astype(np.int64))
    padded_numba = best_seconds(lambda: lossmask.make_labels(ids, CHATML, lengths=lengths), repeat=3)
    benchmark.pedantic(torch_kernel.label_padded, args=(ids_t, CHATML), kwargs=dict(lengths=lengths_t), rounds=3)
    report(benchmark, f"torch label_padded [{len(rows)}, {width}] (CPU)", len(values), padded_numba)
