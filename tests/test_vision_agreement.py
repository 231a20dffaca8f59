"""Every image family against its own processor: on real photographs and the variants the processors must agree on
(EXIF-turned, alpha, palette, CMYK, grayscale, 16-bit, thin, tiny, large), ids and labels row by row; and the
collator's batch, field by field, against the processor's on the same rows. (Apart from ``test_vision_images.py``, its
concept's neighbour, so that the two long files run side by side in ``make test``'s two workers.)

Ground truth is the processor's own output on the image as ``datasets`` and transformers' ``load_image`` open it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402

from lossmask import hf  # noqa: E402
from test_vision import IMG, folders, processor, reference_labels, text  # noqa: E402,F401
from test_vision_images import (  # noqa: E402,F401
    ASSISTANT_IMAGE, all_folders, as_datasets_opens, chat, encoded, llava_markers, photo, sixteen_bit,
)


def photographs():
    """A real photograph where a package here ships one (matplotlib's sample data), else a generated image; and the
    variants the processors must agree on: EXIF-turned, alpha, palette, CMYK, grayscale, 16-bit, a thin strip, a tiny
    one, and a large EXIF-turned JPEG (stored 1125x2000, shown 2000x1125)."""
    import importlib.util

    base = photo(300, 200)
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.submodule_search_locations:
        sample = os.path.join(spec.submodule_search_locations[0], "mpl-data", "sample_data", "grace_hopper.jpg")
        if os.path.isfile(sample):
            base = Image.open(sample).convert("RGB").resize((300, 352))
    rgba = base.copy()
    rgba.putalpha(Image.fromarray(np.tile(np.arange(base.width, dtype=np.uint8), (base.height, 1)), "L"))
    large = encoded(base.resize((1125, 2000)), fmt="JPEG", orientation=6)
    return [encoded(base, orientation=6), rgba, encoded(base.quantize(32)), encoded(base.convert("CMYK"), fmt="JPEG"),
            encoded(base.convert("L")), encoded(sixteen_bit(base)), base.resize((300, 20)), base.resize((20, 15)),
            large]


# family -> (fixture, processor_kwargs, how its labels are checked). "rule": test_vision's reference_labels under the
# named family's tokens; "text": the trained tokens are one run, ending at the turn's stop token (LLaVA: at the row's
# end), that decodes to the answer as the template writes it, and nothing else trains.
AGREEMENT = {
    "qwen2-vl": ("qwen2-vl", {}, ("rule", "qwen2-vl")),
    "qwen2.5-vl": ("qwen2.5-vl", {}, ("rule", "qwen2-vl")),
    "gemma-3": ("gemma-3", {}, ("rule", "gemma-3")),
    "gemma-3-pan-and-scan": ("gemma-3", {"do_pan_and_scan": True}, ("text", "{}<end_of_turn>")),
    "idefics3": ("idefics3", {}, ("rule", "idefics3")),
    "idefics3-1456": ("idefics3-1456", {}, ("rule", "idefics3")),
    "smolvlm": ("smolvlm", {}, ("text", "{}<end_of_utterance>")),
    "llava": ("llava", {}, ("text", "{} ")),
    "llava-next": ("llava-next", {}, ("text", "{} ")),
    "mllama": ("mllama", {}, ("text", "{}<|eot_id|>")),
}
# the answer as each chat() writes it, after the assistant's header; Idefics3-style templates write ": " before text
ANSWERS = {"user": "A photo.", ASSISTANT_IMAGE: "Here it is."}


def text_labels(proc, ids, want, stop):
    """Labels that train exactly the run of tokens that ends at the last ``stop`` token (the row's last token when
    ``stop`` is None) and decodes to ``want``."""
    end = len(ids) - 1 if stop is None else max(k for k, i in enumerate(ids) if i == stop)
    start = next(k for k in range(end, -1, -1) if proc.tokenizer.decode(ids[k:end + 1]) == want)
    return [-100] * start + ids[start:end + 1] + [-100] * (len(ids) - end - 1)


@pytest.mark.parametrize("family", sorted(AGREEMENT))
def test_every_family_agrees_with_its_processor_on_photographs_and_their_variants(all_folders, family):
    """Each image in a user turn and in an assistant turn: ids equal the processor's (``processor(text=...,
    images=...)`` with the family's keywords) on the image as ``datasets`` opens it; labels the rule's (assistant
    text trains, every token of an image's part never does; LLaVA: the answer's text alone trains)."""
    fixture, kwargs, (check, arg) = AGREEMENT[family]
    proc = processor(all_folders, fixture)
    markers = llava_markers(proc) if fixture.startswith("llava") else None
    images = photographs()
    rows = [(where, image) for image in images for where in ("user", ASSISTANT_IMAGE)]
    ds = datasets.Dataset.from_dict({"messages": [chat(where) for where, _ in rows],
                                     "images": [[i if isinstance(i, bytes) else encoded(i)] for _, i in rows]})
    out = hf.mask_dataset(ds, proc, markers=markers, quiet=True, processor_kwargs=kwargs)
    assert len(out) == len(rows)
    for (where, image), got in zip(rows, out):
        messages = chat(where)
        data = image if isinstance(image, bytes) else encoded(image)
        rendered = proc.apply_chat_template(messages, tokenize=False)
        theirs = proc(text=[rendered], images=[[as_datasets_opens(data)]], add_special_tokens=False, **kwargs)
        truth = [int(i) for i in theirs["input_ids"][0]]
        assert got["input_ids"] == truth, (where, len(got["input_ids"]), len(truth))
        if check == "rule":
            want = reference_labels(arg, truth, proc.tokenizer.convert_ids_to_tokens(truth)).tolist()
        else:
            answer = ANSWERS[where]
            if fixture in ("idefics3", "smolvlm") and where == "user":
                answer = " " + answer
            stop = arg.format("")
            stop_id = proc.tokenizer.convert_tokens_to_ids(stop) if stop.strip() else None
            want = text_labels(proc, truth, arg.format(answer), stop_id)
        assert got["labels"] == want, where


def batch_rows():
    """A batch of three rows: one image, two images side by side after text, and no image (a padded row)."""
    first, second, third = photo(112, 56), photo(56, 80, "RGBA"), photo(600, 80)
    two = [{"role": "user", "content": [text("Look"), IMG, IMG, text("What are they, really?")]},
           {"role": "assistant", "content": [text("Two photos.")]}]
    plain = [{"role": "user", "content": [text("Hi")]}, {"role": "assistant", "content": [text("Hello.")]}]
    return [(chat(), [first]), (two, [second, third]), (plain, [])]


@pytest.mark.parametrize("family,side", [*((f, "right") for f in sorted(AGREEMENT)), ("mllama", "left")])
def test_collator_returns_the_processors_fields_and_values_plus_labels(all_folders, family, side):
    """Per set-up, the collator's batch holds exactly the keys the processor returns for the same rows, plus
    ``labels``, each equal to the processor's (``torch.equal``): Mllama's ``cross_attention_mask`` included, and
    nothing the processor drops (Gemma-3's ``num_crops``, Idefics3's ``rows``/``cols``, Mllama's ``num_tiles``). Fields
    laid out per row (Idefics3's and Mllama's ``pixel_values``) follow the rows, a row without images included."""
    import copy

    import torch

    from lossmask.vision import VisionCollator

    fixture, kwargs, _ = AGREEMENT[family]
    proc = processor(all_folders, fixture)
    markers = llava_markers(proc) if fixture.startswith("llava") else None
    rows = batch_rows()
    collator = VisionCollator(proc, markers=markers, padding_side=side, processor_kwargs=kwargs)
    batch = collator([{"messages": m, "images": images} for m, images in rows])
    theirs_proc = proc
    if proc.tokenizer.pad_token is None:  # the processor cannot pad without one: give it the collator's
        theirs_proc = copy.deepcopy(proc)
        theirs_proc.tokenizer.pad_token_id = collator.pad_token_id
    rendered = [proc.apply_chat_template(m, tokenize=False) for m, _ in rows]
    theirs = theirs_proc(text=rendered, images=[images for _, images in rows], add_special_tokens=False,
                         return_tensors="pt", padding=True, padding_side=side, **kwargs)
    assert set(batch) == set(theirs) | {"labels"}
    for name in theirs:
        assert torch.equal(batch[name], theirs[name]), name
    if family == "mllama":  # text before the image sees no tile of it; the row without an image sees none at all
        mask = batch["cross_attention_mask"]
        image = proc.tokenizer.convert_tokens_to_ids("<|image|>")
        first = int((batch["input_ids"][0] == image).nonzero()[0])
        assert mask[0, :first].sum() == 0 and mask[0, first:, 0].sum() > 0 and mask[2].sum() == 0
