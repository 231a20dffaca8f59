"""ChatTokenizer.encode_chats on 2,000 chats, as a ratio to per-row ``apply_chat_template(tokenize=True)``.

The baseline is what a training script does row by row (TRL's and mlx-lm's chat datasets): render and
tokenise each conversation in its own call. ``encode_chats`` renders each row (Jinja is per row
anyway) and tokenises all of them in one batch call, returning one Arrow array.

Run: ``make bench`` (or ``pytest benchmarks/bench_tokenizer.py --benchmark-enable -s``).
Needs the shared tokenizers (``$LOSSMASK_TOKENIZERS``, default ``../shared/tokenizers``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import best_seconds

TOKENIZERS = Path(os.environ.get("LOSSMASK_TOKENIZERS", Path(__file__).resolve().parents[2] / "shared" / "tokenizers"))
N_ROWS = 2_000


def _chat(k: int) -> list[dict]:
    return [
        {"role": "system", "content": "You answer in one short paragraph."},
        {"role": "user", "content": f"Question {k}: what is the capital of France, and why? " * 4},
        {"role": "assistant", "content": f"Answer {k}: Paris, the seat of government since long ago. " * 8},
        {"role": "user", "content": "And of Spain?"},
        {"role": "assistant", "content": f"Madrid, answer {k}. " * 12},
    ]


@pytest.fixture(scope="module")
def chat_tokenizer():
    folder = TOKENIZERS / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"qwen2.5 tokenizer not found in {TOKENIZERS} (set LOSSMASK_TOKENIZERS)")
    from lossmask import load_tokenizer

    return load_tokenizer(folder)


def test_encode_chats_vs_per_row_apply_chat_template(benchmark, chat_tokenizer):
    rows = [_chat(k) for k in range(N_ROWS)]
    hf = chat_tokenizer.tokenizer

    def per_row():
        return [hf.apply_chat_template(r, tokenize=True, return_dict=False) for r in rows]

    baseline = best_seconds(per_row, repeat=3)
    result = benchmark.pedantic(chat_tokenizer.encode_chats, args=(rows,), rounds=3, warmup_rounds=1)
    assert result.errors == ()
    assert result.input_ids[7].as_py() == list(hf.apply_chat_template(rows[7], tokenize=True, return_dict=False))
    seconds = benchmark.stats.stats.min
    n_tokens = len(result.input_ids.values)
    benchmark.extra_info.update(rows_per_s=N_ROWS / seconds, ktok_per_s=n_tokens / seconds / 1e3, ratio_to_per_row=baseline / seconds)
    print(
        f"\nencode_chats qwen2.5: {N_ROWS} rows, {n_tokens / 1e3:.0f} k tokens, {N_ROWS / seconds:,.0f} rows/s; "
        f"per-row apply_chat_template(tokenize=True) {N_ROWS / baseline:,.0f} rows/s; ratio {baseline / seconds:.2f}x"
    )
