"""GPU check: the torch backend and the collator on CUDA, compared with numba, with throughput.

    python benchmarks/gpu_check.py            # on a CUDA machine: a large batch, < 2 minutes
    python benchmarks/gpu_check.py --rows 64  # smaller

Labels a large padded batch with ``label_padded`` on the GPU (right and left padding, and
``last_turn_only``), a padding-free flattened batch with ``label_segments``, and the same rows
through ``CompletionCollator(device="cuda")``; every result must equal the numba labels. Prints
Mtok/s for each next to numba on the CPU. Without CUDA it says so and runs a small CPU pass, so
that the script itself stays tested. Exit status 0 only when every comparison holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CHATML, chatml_rows  # noqa: E402

import lossmask  # noqa: E402


def _timed(fn, sync, repeat=5):
    fn()
    sync()
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best, result


def main(argv=None) -> int:
    import torch

    from lossmask.collator import CompletionCollator
    from lossmask.engine.kernels import torch_kernel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="rows of ~1,000 tokens (default: 4,096 on CUDA, 64 on CPU)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda")
        print(f"CUDA: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        print("no CUDA device found (torch.cuda.is_available() is False): running a small CPU pass instead; "
              "the GPU check did NOT run on a GPU")
        torch.set_num_threads(1)  # small tensors: thread wake-ups cost more than they save on a shared CPU
        sync = lambda: None  # noqa: E731
    n_rows = args.rows or (4096 if cuda else 64)
    started = time.perf_counter()
    rows = chatml_rows(n_rows, seed=7)
    offsets = rows.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    values = rows.values.to_numpy().astype(np.int64)
    n_tokens = len(values)
    width = int(lengths.max())
    ids = np.zeros((n_rows, width), dtype=np.int64)
    row = np.repeat(np.arange(n_rows), lengths)
    col = np.arange(n_tokens) - np.repeat(offsets[:-1], lengths)
    ids[row, col] = values
    failures = []

    def check(name, ok):
        if not ok:
            failures.append(name)
        return "equal to numba" if ok else "DIFFERS FROM NUMBA"

    lossmask.make_labels(rows.slice(0, 4), CHATML)  # numba compile
    numba_s, want = _timed(lambda: lossmask.make_labels(ids, CHATML, lengths=lengths), lambda: None, repeat=3)
    want_lto = lossmask.make_labels(ids, CHATML, lengths=lengths, last_turn_only=True)
    print(f"{n_rows} rows, {n_tokens / 1e6:.2f} M tokens, padded width {width}; "
          f"numba (CPU): {n_tokens / numba_s / 1e6:,.0f} Mtok/s")

    ids_d = torch.from_numpy(ids).to(device)
    lengths_d = torch.from_numpy(lengths).to(device)
    for name, kwargs, expected in [
        ("label_padded right", dict(lengths=lengths_d), want),
        ("label_padded last_turn_only", dict(lengths=lengths_d, last_turn_only=True), want_lto),
    ]:
        seconds, got = _timed(lambda: torch_kernel.label_padded(ids_d, CHATML, **kwargs), sync)
        verdict = check(name, np.array_equal(got.cpu().numpy(), expected))
        print(f"  {name:34s} {n_tokens / seconds / 1e6:10,.0f} Mtok/s  {verdict}")

    left = np.zeros_like(ids)
    left[row, col + (width - lengths)[row]] = values
    mask_d = torch.from_numpy((left != 0) | (np.arange(width)[None, :] >= (width - lengths)[:, None])).to(device)
    left_d = torch.from_numpy(left).to(device)
    seconds, got = _timed(lambda: torch_kernel.label_padded(left_d, CHATML, attention_mask=mask_d), sync)
    got = got.cpu().numpy()
    left_want = np.full_like(want, -100)
    left_want[row, col + (width - lengths)[row]] = want[row, col]
    verdict = check("label_padded left", np.array_equal(got, left_want))
    print(f"  {'label_padded left (attention_mask)':34s} {n_tokens / seconds / 1e6:10,.0f} Mtok/s  {verdict}")

    flat_d = torch.from_numpy(values).to(device)
    cu_d = torch.from_numpy(offsets).to(device)
    seconds, got = _timed(lambda: torch_kernel.label_segments(flat_d, cu_d, CHATML), sync)
    verdict = check("label_segments", np.array_equal(got.cpu().numpy(), want[row, col]))
    print(f"  {'label_segments (padding-free)':34s} {n_tokens / seconds / 1e6:10,.0f} Mtok/s  {verdict}")

    batch_rows = 16
    examples = [{"input_ids": r} for r in rows.slice(0, batch_rows).to_pylist()]
    for padding_free in (False, True):
        collate = CompletionCollator(markers=CHATML, pad_token_id=0, device=device, padding_free=padding_free)
        part = examples[:batch_rows]
        seconds, batch = _timed(lambda: collate(part), sync)
        labels = batch["labels"].cpu().numpy()
        n_part = int(lengths[:batch_rows].sum())
        if padding_free:
            expected = want[row[:n_part], col[:n_part]].copy()
            expected[offsets[:batch_rows]] = -100
            ok = np.array_equal(labels[0, :n_part], expected)
        else:
            ok = np.array_equal(labels, want[:batch_rows, : labels.shape[1]])
        name = f"collator {batch_rows} rows{' padding-free' if padding_free else ''}"
        print(f"  {name:34s} {n_part / seconds / 1e6:10,.1f} Mtok/s  {check(name, ok)}  ({seconds * 1e3:.1f} ms/batch)")

    print(f"done in {time.perf_counter() - started:.1f} s on {'CUDA' if cuda else 'CPU (no CUDA)'}; "
          + ("all equal to numba" if not failures else f"FAILED: {failures}"))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
