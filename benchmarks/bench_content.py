"""The cost of keeping message text as data, on the messages path, as a ratio to the path without it.

Same run, same 2,000 chats (examples/make_chats.py), same rendering: the baseline tokenises the
rendered rows with ``encode_texts`` and labels them (what lossmask did before message text was kept as data); the measured
path is ``encode_rendered`` (locate every message, check special-token strings, offsets where
the markers need them) plus ``label_batch(data_mask=...)``. Qwen2.5's markers hold special tokens only,
so message text cannot match them and no offsets are needed; Llama-2's ``[/INST]`` is plain text, so
rows whose messages hold ``INST`` get them. Rendering (Jinja, the same in both) is left out; add it to both sides for the whole job.

    .venv/bin/python -m pytest benchmarks/bench_content.py -q -s
"""

from __future__ import annotations

import random
import sys
import time
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TOKENIZERS = HERE.parent.parent / "shared" / "tokenizers"
N_ROWS = 2000


def best_of(fn, repeat=5):
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("family", ["qwen2.5", "llama-2"])
def test_content_as_data_cost(benchmark, family):
    if not (TOKENIZERS / family).is_dir():
        pytest.skip(f"no tokenizer {family} in {TOKENIZERS}")
    from lossmask import label_batch, load_tokenizer
    from lossmask.markers.detect import detect_markers
    from lossmask.chat.encode_batch import render_chats
    from lossmask.chat.encode_rendered import encode_rendered, text_can_match

    sys.path.insert(0, str(HERE.parent / "examples"))
    import make_chats

    ct = load_tokenizer(TOKENIZERS / family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        markers = detect_markers(ct)
    rng = random.Random(0)
    chats = [make_chats.chat(rng) for _ in range(N_ROWS)]
    texts, _ = render_chats(ct, chats)
    positions = text_can_match(ct, markers, "text")
    ct.content_tokens  # the per-tokenizer analysis, once per job

    def before():
        label_batch(ct.encode_texts(texts), markers)

    def after():
        encoded = encode_rendered(ct, texts, chats, positions=positions)
        label_batch(encoded.input_ids, markers, data_mask=encoded.in_content)

    base = best_of(before)
    new = best_of(after)
    render = best_of(lambda: render_chats(ct, chats), 2)
    benchmark.pedantic(after, rounds=1, iterations=1)
    where = "all rows" if positions is True else "no row" if not positions else "rows naming a marker's words"
    benchmark.extra_info.update(ratio=new / base, with_render_ratio=(new + render) / (base + render), offsets=where)
    print(f"\n{family}: tokenise+label {base * 1e3:.0f} ms before, {new * 1e3:.0f} ms with content as data "
          f"({new / base:.2f}x; offsets for {where}); with rendering ({render * 1e3:.0f} ms): "
          f"{(new + render) / (base + render):.2f}x")
