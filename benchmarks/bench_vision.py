"""Labelling image chats against the processor's own preprocessing, same rows, same run.

2,000 chats (one to three turns, one or two small images each, 28 to 112 pixels a side), in batches of 16 as a
trainer's collator sees them, through a processor fixture (the real tokenizer with the published image-processor
config and chat template, ``tests/fixtures/vision``):

- ``processor``: what a trainer pays anyway: ``processor(text=rendered, images=images)`` (the image step, the
  expansion and the tokenisation), on chats rendered beforehand (TRL renders them with
  ``processor.apply_chat_template`` first; that rendering is not counted here);
- ``labels``: the labels alone (the engine on each batch's ids, message text inert, every media token masked), as a
  share of the baseline (target: under 5 %);
- ``VisionCollator``: all of it (render, open the images, the processor's image step, expand, tokenise, locate the
  message text, label), against rendering plus the baseline, which is what TRL's vision collator does; and all of
  it but the image step, as a share of the baseline.

Run: ``PYTHONPATH=src python benchmarks/bench_vision.py [--rows 2000] [--family qwen2-vl]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from conftest import vision_processor_dir  # noqa: E402

# markers given as strings (a family whose markers detection cannot verify; none of the benchmarked ones)
GIVEN_PARTS: dict = {}


def make_rows(n: int, seed: int = 0):
    from PIL import Image

    rng = random.Random(seed)
    words = "the a red green blue square circle picture shows left right top of in and with small large".split()

    def sentence(k):
        return " ".join(rng.choice(words) for _ in range(k)).capitalize() + "."

    rows = []
    for _ in range(n):
        images, messages = [], []
        for turn in range(rng.randint(1, 3)):
            parts = [{"type": "text", "text": sentence(rng.randint(4, 12))}]
            if turn == 0 or rng.random() < 0.3:
                for _ in range(1 if turn else rng.randint(1, 2)):
                    parts.insert(rng.randint(0, len(parts)), {"type": "image"})
                    size = (rng.randint(28, 112), rng.randint(28, 112))
                    images.append(Image.new("RGB", size, tuple(rng.randint(0, 255) for _ in range(3))))
            messages.append({"role": "user", "content": parts})
            messages.append({"role": "assistant", "content": [{"type": "text", "text": sentence(rng.randint(6, 30))}]})
        rows.append({"messages": messages, "images": images})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--family", default="qwen2-vl", choices=["qwen2-vl", "gemma-3", "idefics3"])
    args = parser.parse_args(argv)

    from lossmask import load_tokenizer, markers_from_strings
    from lossmask.chat.media import load_processor, processor_images
    from lossmask.vision import VisionCollator

    processor = load_processor(vision_processor_dir(args.family, Path(tempfile.mkdtemp())))
    if processor.tokenizer.pad_token is None:  # Llama-3.1 has none: the baseline pads with EOS, as the collator does
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    parts = GIVEN_PARTS.get(args.family)
    markers = markers_from_strings(load_tokenizer(processor), **parts) if parts else None
    collator = VisionCollator(processor, markers=markers)
    rows = make_rows(args.rows)
    batches = [rows[i:i + args.batch] for i in range(0, len(rows), args.batch)]
    rendered = [[processor.apply_chat_template(r["messages"], tokenize=False) for r in b] for b in batches]
    collator(batches[0])  # warm: the fast tokeniser and the renderer are proven on a job's first rows
    n_images = sum(len(r["images"]) for r in rows)

    def run_render():
        for b in batches:
            [processor.apply_chat_template(r["messages"], tokenize=False) for r in b]

    def run_processor():
        for b, texts in zip(batches, rendered):
            processor(text=texts, images=[r["images"] for r in b], add_special_tokens=False, padding=True)

    def run_images():
        for b in batches:
            processor_images(processor, [im for r in b for im in r["images"]])

    def run_lossmask():
        for b in batches:
            collator(b)

    import pyarrow as pa

    from lossmask.chat.encode_media import encode_media_table
    from lossmask.engine.labels import label_batch
    from lossmask.vision import _split_images

    encoded = []
    for b in batches:
        split = [_split_images(r["messages"], r["images"]) for r in b]
        table = pa.Table.from_pylist([{"messages": m} for m, _ in split])
        done = encode_media_table(collator.chat, table, collator.options, images=[i for _, i in split])
        encoded.append(dataclasses.replace(done, media=None))  # ids only: 2,000 rows of pixel values would not fit

    def run_labels():  # the labels alone: the engine on the batch's ids, message text inert, media tokens masked
        for e in encoded:
            label_batch(e.input_ids, collator.markers, data_mask=e.in_content)

    timings = {}
    steps = (("render", run_render), ("processor", run_processor), ("images", run_images), ("collator", run_lossmask),
             ("labels", run_labels))
    for name, fn in steps * 2:
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
        timings[name] = min(timings.get(name, seconds), seconds)  # best of two passes each, interleaved
    base = timings["processor"]
    trl_like = timings["render"] + base
    extra = timings["collator"] - timings["images"]
    print(f"{args.family}: {args.rows} chats, {n_images} images, batches of {args.batch}")
    print(f"  processor(text, images) on rendered chats:          {base:.3f} s  (the baseline)")
    print(f"  rendering them (processor.apply_chat_template):     {timings['render']:.3f} s")
    print(f"  VisionCollator, all of it:                          {timings['collator']:.3f} s = "
          f"{timings['collator'] / trl_like:.2f}x rendering + processor, as TRL's vision collator does")
    print(f"  the processor's image step alone:                   {timings['images']:.3f} s")
    print(f"  the labels alone (engine, media masked):            {timings['labels']:.3f} s = "
          f"{timings['labels'] / base:.2%} of the baseline")
    print(f"  all lossmask does but the image step (render, expand, tokenise, locate text, label): {extra:.3f} s = "
          f"{extra / base:.1%} of the baseline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
