"""Vision-language chats through a processor (Qwen2-VL, Gemma-3, Idefics3; LLaVA with given markers).

Labels are held to a reference written from the rule, on the processor's own tokenisation: an assistant turn trains
from after its header through its stop token, and no media token (the processor's image token, its expansion, the
begin and end tokens around it) ever trains. Text-only rows are labelled as without a processor.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from conftest import vision_processor_dir

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from PIL import Image  # noqa: E402

from lossmask import hf, load_tokenizer, mask_files  # noqa: E402
from lossmask.chat.media import MediaDetectionError, load_processor, media_tokens  # noqa: E402
from lossmask.chat.tokenizer import ChatTokenizer  # noqa: E402

FAMILIES = ("qwen2-vl", "gemma-3", "idefics3")
# what the rule says for each family, written by hand here (the code derives them from the processor): the assistant
# header's tokens (a last "\n" stands for the token holding the header's newline), the stop token, the media tokens.
# Idefics3 writes its tile and global-image tags (<row_1_col_1>, <global-img>) and the newlines between tile rows as
# plain text inside the image, and Gemma-3 a blank line on each side of it: part of the image, never trained.
HEADER = {"qwen2-vl": ("<|im_start|>", "assistant", "\n"), "gemma-3": ("<start_of_turn>", "model", "\n"),
          "idefics3": ("Assistant", ":")}
STOP = {"qwen2-vl": "<|im_end|>", "gemma-3": "<end_of_turn>", "idefics3": "<end_of_utterance>"}
# where one image's tokens open and close (Idefics3: the tag token that closes the global image, the last tile)
IMAGE_OPEN = {"qwen2-vl": "<|vision_start|>", "gemma-3": "<start_of_image>", "idefics3": "<fake_token_around_image>"}
IMAGE_CLOSE = {"qwen2-vl": "<|vision_end|>", "gemma-3": "<end_of_image>", "idefics3": "<fake_token_around_image>"}
MEDIA = {"qwen2-vl": {"<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"},  # its videos' too
         "gemma-3": {"<start_of_image>", "<image_soft_token>", "<end_of_image>"},
         "idefics3": {"<fake_token_around_image>", "<image>"}}

# LLaVA-1.5's template writes no stop token: detection cannot verify markers there (it refuses, tested), so its
# markers are given as strings. Idefics3's template renders text parts only; string contents are given to it as parts,
# and its markers are detected like any family's.
LLAVA_PARTS = {"response": "ASSISTANT:", "instruction": "USER:"}
GIVEN_PARTS: dict = {}

_PROCESSORS: dict = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision")
    yield {family: vision_processor_dir(family, out) for family in (*FAMILIES, "llava")}
    _PROCESSORS.clear()  # loaded once for this file's tests, given back after them


def processor(folders, family):
    if family not in _PROCESSORS:
        _PROCESSORS[family] = load_processor(folders[family])
    return _PROCESSORS[family]


def given_markers(proc, family):
    """The markers a family's tests pass (None: detected from the processor's template)."""
    from lossmask import markers_from_strings

    return markers_from_strings(load_tokenizer(proc), **GIVEN_PARTS[family]) if family in GIVEN_PARTS else None


def image(w, h, colour=(200, 30, 30)):
    return Image.new("RGB", (w, h), colour)


def png(w, h, colour=(30, 200, 30)) -> bytes:
    buffer = io.BytesIO()
    image(w, h, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def text(t):
    return {"type": "text", "text": t}


IMG = {"type": "image"}


def chats():
    """Multi-turn, multi-image chats (images at the start, middle and end of turns, two in one message, one inside an
    assistant turn) and a text-only chat, each with its images."""
    return [
        ([{"role": "user", "content": [IMG, text("What is this?")]},
          {"role": "assistant", "content": [text("A red square.")]},
          {"role": "user", "content": [text("And these two?"), IMG, IMG]},
          {"role": "assistant", "content": [text("A green bar and a blue one.")]}],
         [image(64, 48), image(30, 90, (0, 200, 0)), image(120, 40, (0, 0, 200))]),
        ([{"role": "user", "content": [text("Draw me a square.")]},
          {"role": "assistant", "content": [IMG, text("Here it is.")]},
          {"role": "user", "content": [text("Thanks!")]},
          {"role": "assistant", "content": [text("You are welcome."), IMG]}],
         [image(56, 56), image(100, 70)]),
        ([{"role": "user", "content": [text("Hello")]},
          {"role": "assistant", "content": [text("Hi, how can I help?")]}], []),
    ]


def reference_labels(family, ids, tokens, inside_only=False):
    """The rule, on the processor's tokens: after each assistant header (its tokens, the last one holding the header's
    newline where it ends with one) through the stop token, each image's tokens (open to close) excepted."""
    *head, last = HEADER[family]
    labels = np.full(len(ids), -100, dtype=np.int64)
    inside = np.zeros(len(ids), dtype=bool)
    open_at, seen = None, ""
    for k, token in enumerate(tokens):
        if open_at is None and token == IMAGE_OPEN[family]:
            open_at, seen = k, ""
        elif open_at is not None and token == IMAGE_CLOSE[family] and (family != "idefics3" or "global" in seen):
            lo, hi = open_at, k + 1
            if family == "gemma-3":  # a blank line on each side of the image: the tokens holding them are the image's
                lo -= tokens[lo - 1].strip() == "" and "\n" in tokens[lo - 1]
                hi += hi < len(tokens) and tokens[hi].strip() == "" and "\n" in tokens[hi]
            inside[lo:hi], open_at = True, None
        elif open_at is not None:
            seen += token
    assert open_at is None
    if inside_only:  # where the images' tokens are
        return inside
    k = 0
    while k < len(ids):
        if tokens[k:k + len(head)] == list(head) and k + len(head) < len(ids):
            if last == "\n":
                assert tokens[k + len(head)].startswith("\n") or tokens[k + len(head)].startswith("Ċ")
            elif tokens[k + len(head)] != last:
                k += 1
                continue
            k += len(head) + 1
            while k < len(ids):
                if tokens[k] not in MEDIA[family] and not inside[k]:
                    labels[k] = ids[k]
                if tokens[k] == STOP[family]:
                    break
                k += 1
        k += 1
    return labels


def processor_ids(proc, messages, images):
    rendered = proc.apply_chat_template(messages, tokenize=False)
    kwargs = {"images": [images]} if images else {}
    return [int(i) for i in proc(text=[rendered], add_special_tokens=False, **kwargs)["input_ids"][0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_media_tokens_are_derived_from_the_processor(folders, family):
    tok = load_tokenizer(folders[family])
    assert tok.processor is not None
    media = media_tokens(tok)
    assert set(tok.convert_ids_to_tokens(media.ids)) == MEDIA[family]
    assert media.placeholder == tok.processor.image_token


@pytest.mark.parametrize("family", FAMILIES)
def test_image_chats_are_labelled_exactly(folders, family):
    proc = processor(folders, family)
    rows = chats()
    ds = datasets.Dataset.from_list([{"messages": m, "images": i} for m, i in rows])
    out, report = hf.mask_dataset(ds, proc, given_markers(proc, family), return_report=True, keep_dropped=True,
                                  quiet=True)
    assert report.rows_out == len(rows)
    media_total = 0
    for (messages, images), got in zip(rows, out):
        ids = processor_ids(proc, messages, images)
        assert got["input_ids"] == ids  # lossmask tokenises exactly as the processor does
        tokens = proc.tokenizer.convert_ids_to_tokens(ids)
        want = reference_labels(family, ids, tokens)
        assert got["labels"] == want.tolist()
        media_total += sum(t in MEDIA[family] for t in tokens)
    assert report.media_tokens == media_total > 0
    assert "media tokens" in report.summary()


@pytest.mark.parametrize("family", ["qwen2-vl", "idefics3"])
def test_without_markers_every_token_trains_but_the_images(folders, family):
    """The policy's "no masking" outcome (no markers): images are still never trained, inside them included."""
    import pyarrow as pa

    from lossmask import MaskOptions
    from lossmask.engine import Tally
    from lossmask.jobs.batch_step import mask_batch

    proc = processor(folders, family)
    rows = chats()[:2]
    table = pa.table({"messages": [[json.dumps(m) for m in messages] for messages, _ in rows],
                      "images": [[png(img.width, img.height) for img in images] for _, images in rows]})
    out = mask_batch(table, None, MaskOptions(), Tally(), tokenizer=load_tokenizer(proc), kind="messages")
    for (messages, images), ids, labels in zip(rows, out.column("input_ids").to_pylist(), out.column("labels").to_pylist()):
        tokens = proc.tokenizer.convert_ids_to_tokens(ids)
        want = np.asarray(ids)
        want[reference_labels(family, ids, tokens, inside_only=True)] = -100
        assert labels == want.tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_text_only_rows_are_labelled_as_without_a_processor(folders, family):
    proc = processor(folders, family)
    rows = chats()
    ds = datasets.Dataset.from_list([{"messages": m, "images": i} for m, i in rows])
    markers = given_markers(proc, family)
    with_images = hf.mask_dataset(ds, proc, markers, keep_dropped=True, quiet=True)
    text_rows = [{"messages": m} for m, i in rows if not i]
    plain = ChatTokenizer(proc.tokenizer, chat_template=proc.chat_template)  # today's path: a tokenizer, no images
    today = hf.mask_dataset(datasets.Dataset.from_list(text_rows), plain, markers and given_markers(plain, family),
                            keep_dropped=True, quiet=True)
    mine = [r for r, (_, i) in zip(with_images, rows) if not i]
    assert [r["labels"] for r in mine] == [r["labels"] for r in today]
    assert [r["input_ids"] for r in mine] == [r["input_ids"] for r in today]


def test_images_as_paths_bytes_pil_data_urls_and_inline_parts(folders, tmp_path):
    proc = processor(folders, "qwen2-vl")
    path = tmp_path / "square.png"
    path.write_bytes(png(64, 48))
    data_url = "data:image/png;base64," + base64.b64encode(png(64, 48)).decode()
    messages = [{"role": "user", "content": [IMG, text("What is it?")]},
                {"role": "assistant", "content": [text("A square.")]}]
    forms = [str(path), png(64, 48), image(64, 48, (30, 200, 30)), data_url]
    outs = []
    for form in forms:
        out = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [messages], "images": [[form]]}), proc, quiet=True)
        outs.append((out[0]["input_ids"], out[0]["labels"]))
    inline = [{"role": "user", "content": [{"type": "image", "image": str(path)}, text("What is it?")]},
              {"role": "assistant", "content": [text("A square.")]}]
    out = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [inline]}), proc, quiet=True)
    outs.append((out[0]["input_ids"], out[0]["labels"]))
    assert all(o == outs[0] for o in outs)


def test_unusable_images_are_invalid_and_named(folders):
    proc = processor(folders, "qwen2-vl")
    ok = [{"role": "user", "content": [IMG, text("What is it?")]}, {"role": "assistant", "content": [text("A square.")]}]
    url = [{"role": "user", "content": [{"type": "image", "url": "https://example.com/a.png"}, text("What is it?")]},
           {"role": "assistant", "content": [text("A square.")]}]
    two = [{"role": "user", "content": [IMG, IMG, text("What are they?")]},
           {"role": "assistant", "content": [text("Squares.")]}]
    rows = {"messages": [ok, ok, two], "images": [[png(40, 40)], [b"not an image"], [png(40, 40)]]}
    ds = datasets.Dataset.from_dict(rows)
    _, report = hf.mask_dataset(ds, proc, return_report=True, quiet=True, max_drop_fraction=1.0)
    assert report.rows_out == 1 and report.dropped["invalid"] == 2
    examples = " ".join(report.invalid_examples)
    assert "row 1: image 0 cannot be opened" in examples
    assert "row 2: 1 image(s) given for 2 image placeholder(s)" in examples
    # a URL is never fetched: refused unless the row gives the image itself
    refused = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [url]}), proc, return_report=True, quiet=True,
                              max_drop_fraction=1.0)[1]
    assert "never fetches" in refused.invalid_examples[0]
    given = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [url], "images": [[png(40, 40)]]}), proc, quiet=True)
    assert len(given) == 1
    video = [{"role": "user", "content": [{"type": "video"}, text("What happens?")]},
             {"role": "assistant", "content": [text("Nothing.")]}]
    refused = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [video]}), proc, return_report=True, quiet=True,
                              max_drop_fraction=1.0)[1]
    assert "video 0: a video part has no video" in refused.invalid_examples[0]  # Qwen2-VL expands videos' frames


def test_an_image_cut_by_max_length_is_an_error_naming_the_row(folders):
    proc = processor(folders, "gemma-3")
    messages = [{"role": "user", "content": [text("Look:"), IMG]}, {"role": "assistant", "content": [text("Nice.")]}]
    ds = datasets.Dataset.from_dict({"messages": [messages], "images": [[png(40, 40)]]})
    with pytest.raises(ValueError, match="row 0: .* image tokens .* but the processor made 256"):
        hf.mask_dataset(ds, proc, max_length=100, quiet=True)


def test_a_template_of_text_parts_only_takes_string_contents_as_parts(folders):
    """Idefics3's (and LLaVA's) template writes list content only: string contents lost their text (content_dropped)
    and detection found no markers. They are now given to it as one text part each, on every render path."""
    from lossmask import detect_markers, verify

    proc = processor(folders, "idefics3")
    tok = load_tokenizer(proc)
    assert tok.renders_parts_only and load_tokenizer(folders["llava"]).renders_parts_only
    assert not load_tokenizer(folders["qwen2-vl"]).renders_parts_only
    markers = detect_markers(tok)
    assert tok.decode(markers.response[0]) == "Assistant:" and tok.decode(markers.end[0]) == "<end_of_utterance>"
    assert verify(tok, markers).ok
    as_strings = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    as_parts = [{"role": m["role"], "content": [text(m["content"])]} for m in as_strings]
    assert tok.render(as_strings) == tok.render(as_parts)
    (first,), (second,) = (hf.mask_dataset(datasets.Dataset.from_list([{"messages": chat}]), proc, quiet=True)
                           for chat in (as_strings, as_parts))
    assert first["labels"] == second["labels"] and tok.decode([t for t in first["labels"] if t != -100]) == \
        " Hello.<end_of_utterance>"
    with pytest.raises(Exception, match="do not reproduce its ground truth"):  # LLaVA: no stop token to verify
        detect_markers(load_tokenizer(folders["llava"]))


def test_detection_refuses_a_template_that_drops_images(folders):
    tok = load_tokenizer(folders["qwen2-vl"])
    blind = ChatTokenizer(tok.tokenizer, chat_template=(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    blind.processor = tok.processor
    with pytest.raises(MediaDetectionError, match="does not write the processor's image token"):
        media_tokens(blind)


def test_mask_files_takes_a_processor_folder(folders, tmp_path):
    path = tmp_path / "square.png"
    path.write_bytes(png(64, 48))
    rows = [{"messages": [{"role": "user", "content": [{"type": "image", "image": str(path)}, text("What is it?")]},
                          {"role": "assistant", "content": [text("A square.")]}]},
            {"messages": [{"role": "user", "content": [text("Hi")]}, {"role": "assistant", "content": [text("Hello.")]}]}]
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    report = mask_files(source, tmp_path / "out.parquet", tokenizer=folders["qwen2-vl"], progress=False)
    assert report.rows_out == 2 and report.media_tokens > 0
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out.parquet")
    tok = load_tokenizer(folders["qwen2-vl"])
    trained = [tok.decode([i for i, l in zip(ids, lab) if l != -100])
               for ids, lab in zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist())]
    assert trained == ["A square.<|im_end|>", "Hello.<|im_end|>"]


# -- the collator, and one training step of a tiny random model of each kind ----------------------------------

# the tests that run a model take their processor's images small: each image's tokens and the logits of three rows over
# a large vocabulary (Gemma-3's 262,208 tokens) then take megabytes, not gigabytes. Expansion, tokens and labels follow
# the same code as at full size (tested above). Gemma-3: 224 pixels and 16 tokens an image (its own: 896 and 256);
# Idefics3: one 112-pixel tile of 16 tokens, no splitting (its own: up to 2x2 tiles + 1 of 364 pixels, 169 tokens each).
SMALL_IMAGES = {
    "gemma-3": {"processor_config.json": {"image_seq_length": 16},
                "preprocessor_config.json": {"image_seq_length": 16, "size": {"height": 224, "width": 224}}},
    "idefics3": {"processor_config.json": {"image_seq_len": 16},
                 "preprocessor_config.json": {"do_image_splitting": False, "max_image_size": {"longest_edge": 112},
                                              "size": {"longest_edge": 112}}},
}


def small_processor(folders, family, out):
    """``family``'s processor with the small images of ``SMALL_IMAGES``."""
    import shutil

    folder = out / f"{family}-small"
    shutil.copytree(folders[family], folder)
    for name, changes in SMALL_IMAGES[family].items():
        config = json.loads((folder / name).read_text(encoding="utf-8"))
        (folder / name).write_text(json.dumps({**config, **changes}), encoding="utf-8")
    return load_processor(folder)


def tiny_model(family):
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "qwen2-vl":
        config = transformers.Qwen2VLConfig(
            text_config=dict(vocab_size=151657, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                             rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
        return transformers.Qwen2VLForConditionalGeneration(config)
    if family == "idefics3":  # SMALL_IMAGES' 112-pixel tiles of 14-pixel patches, merged 2x2: 16 tokens per tile
        config = transformers.Idefics3Config(
            text_config=dict(model_type="llama", vocab_size=128259, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=4096, pad_token_id=128002),
            vision_config=dict(image_size=112, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2),
            scale_factor=2, image_token_id=128257)
        return transformers.Idefics3ForConditionalGeneration(config)
    config = transformers.Gemma3Config(  # SMALL_IMAGES' 224 pixels: 16x16 patches pooled to 4x4, 16 tokens
        text_config=dict(vocab_size=262208, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                         sliding_window=512),
        vision_config=dict(image_size=224, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2),
        mm_tokens_per_image=16, image_token_index=262144, boi_token_index=255999, eoi_token_index=256000)
    return transformers.Gemma3ForConditionalGeneration(config)


@pytest.mark.parametrize("family", FAMILIES)
def test_collator_batch_trains_a_tiny_model_with_the_hand_computed_loss(folders, family, tmp_path):
    import torch

    from lossmask.vision import VisionCollator

    proc = small_processor(folders, family, tmp_path) if family in SMALL_IMAGES else processor(folders, family)
    rows = chats()
    collator = VisionCollator(proc, markers=given_markers(proc, family))
    batch = collator([{"messages": m, "images": i} for m, i in rows])
    # the labels are the rule's, row by row, on the processor's own tokens
    for r, (messages, images) in enumerate(rows):
        ids = processor_ids(proc, messages, images)
        n = len(ids)
        assert batch["input_ids"][r, :n].tolist() == ids
        assert batch["labels"][r, :n].tolist() == reference_labels(
            family, ids, proc.tokenizer.convert_ids_to_tokens(ids)).tolist()
        assert (batch["labels"][r, n:] == -100).all() and (batch["attention_mask"][r, n:] == 0).all()
    assert "pixel_values" in batch
    model = tiny_model(family)
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(**batch)
    targets = batch["labels"][:, 1:]
    trained = targets != -100
    # log-softmax of the trained positions' logits alone (the same numbers as taken from the whole batch's)
    log_probs = torch.log_softmax(out.logits.detach().float()[:, :-1][trained], dim=-1)
    hand = -(log_probs.gather(1, targets[trained].unsqueeze(1))).sum() / trained.sum()
    first = out.loss.item()
    assert abs(first - hand.item()) < 1e-5
    out.loss.backward()
    optimiser.step()
    del out, log_probs  # the first step's logits, given back before the second
    again = model(**batch).loss.item()
    assert np.isfinite(again) and again != first


def test_sft_trainer_runs_with_the_vision_collator(folders, tmp_path):
    trl = pytest.importorskip("trl")
    from lossmask.vision import VisionCollator

    proc = processor(folders, "qwen2-vl")
    rows = chats()
    ds = datasets.Dataset.from_list([{"messages": m, "images": i} for m, i in rows])
    config = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=3, report_to=[],
                           remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True},
                           logging_steps=1, save_strategy="no", use_cpu=True)
    trainer = trl.SFTTrainer(model=tiny_model("qwen2-vl"), args=config, train_dataset=ds, processing_class=proc,
                             data_collator=VisionCollator(proc))
    result = trainer.train()
    assert np.isfinite(result.training_loss)


def test_collator_takes_string_and_part_contents_in_one_batch(folders):
    from lossmask.vision import VisionCollator

    proc = processor(folders, "qwen2-vl")
    rows = [{"messages": [{"role": "user", "content": [IMG, text("What is it?")]},
                          {"role": "assistant", "content": "A square."}], "images": [image(40, 40)]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "images": []}]
    batch = VisionCollator(proc)(rows)
    trained = [proc.tokenizer.decode(batch["input_ids"][r][batch["labels"][r] != -100]) for r in range(2)]
    assert trained == ["A square.<|im_end|>", "Hello.<|im_end|>"]


def llava_reference(ids, tokens, response, instruction):
    """The marker rule written out for LLaVA-1.5 (no stop token): after each ``ASSISTANT:`` until the next ``USER:``,
    each image part excepted: its ``<image>`` tokens, the newline the template writes after them (the tokeniser's
    space after a special token, then ``<0x0A>``) and the separator space left alone before them."""
    part = np.zeros(len(ids), dtype=bool)
    for k, token in enumerate(tokens):
        if token == "<image>":
            part[k] = True
            if k and tokens[k - 1] == "▁":
                part[k - 1] = True
            if k + 1 < len(tokens) and tokens[k + 1] != "<image>":
                after = k + 1 + (tokens[k + 1] == "▁")
                part[k + 1:after + (after < len(tokens) and tokens[after] == "<0x0A>")] = True
    labels = np.full(len(ids), -100, dtype=np.int64)
    inside = False
    k = 0
    while k < len(ids):
        if ids[k:k + len(response)] == response:
            inside, k = True, k + len(response)
            continue
        if ids[k:k + len(instruction)] == instruction:
            inside = False
        if inside and not part[k]:
            labels[k] = ids[k]
        k += 1
    return labels


def test_llava_with_given_markers_masks_every_image_token_and_trains_a_tiny_model(folders):
    import torch
    import transformers

    from lossmask import markers_from_strings
    from lossmask.vision import VisionCollator

    proc = processor(folders, "llava")
    tok = load_tokenizer(proc)
    assert set(tok.convert_ids_to_tokens(media_tokens(tok).ids)) == {"<image>"}
    markers = markers_from_strings(tok, response=LLAVA_PARTS["response"], instruction=LLAVA_PARTS["instruction"])
    rows = chats()
    ds = datasets.Dataset.from_list([{"messages": m, "images": i} for m, i in rows])
    out = hf.mask_dataset(ds, proc, markers=markers, keep_dropped=True, quiet=True)
    response, instruction = list(markers.response[0]), list(markers.instruction[0])
    for (messages, images), got in zip(rows, out):
        ids = processor_ids(proc, messages, images)
        assert got["input_ids"] == ids
        assert got["labels"] == llava_reference(ids, proc.tokenizer.convert_ids_to_tokens(ids), response,
                                                instruction).tolist()
    batch = VisionCollator(proc, markers=markers)([{"messages": m, "images": i} for m, i in rows])
    assert (batch["labels"] == 32000).sum() == 0 and (batch["input_ids"] == 32000).sum() == 576 * 5
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", image_size=336, patch_size=14, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, projection_dim=32),
        text_config=dict(model_type="llama", vocab_size=32064, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096),
        image_token_index=32000, vision_feature_layer=-2, vision_feature_select_strategy="default")
    model = transformers.LlavaForConditionalGeneration(config)
    model.train()
    with torch.no_grad():  # the loss alone, no step: nothing kept for a backward pass
        loss = model(**batch)
    targets = batch["labels"][:, 1:]
    trained = targets != -100
    # log-softmax of the trained positions' logits alone (the same numbers as taken from the whole batch's)
    log_probs = torch.log_softmax(loss.logits.float()[:, :-1][trained], dim=-1)
    hand = -(log_probs.gather(1, targets[trained].unsqueeze(1))).sum() / trained.sum()
    assert abs(loss.loss.item() - hand.item()) < 1e-5


def test_cli_mask_takes_a_processor_folder_as_tokenizer(folders, tmp_path, capsys):
    from lossmask.cli import main

    path = tmp_path / "square.png"
    path.write_bytes(png(50, 50))
    row = {"messages": [{"role": "user", "content": [{"type": "image", "image": str(path)}, text("What?")]},
                        {"role": "assistant", "content": [text("A square.")]}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    main(["mask", str(tmp_path / "in.jsonl"), str(tmp_path / "out.parquet"), "--tokenizer", str(folders["qwen2-vl"])])
    assert "media tokens (images and videos, never trained)" in capsys.readouterr().out


def test_train_on_responses_only_points_a_vision_trainer_to_the_vision_collator(folders):
    from types import SimpleNamespace

    trainer = SimpleNamespace(processing_class=processor(folders, "qwen2-vl"), args=None)
    with pytest.raises(ValueError, match="VisionCollator"):
        hf.train_on_responses_only(trainer)


def test_collator_refuses_a_row_whose_labels_break_the_role_invariant_naming_it(folders):
    """The collator holds rows to the role invariant as ``mask_files`` does: markers that train a user's text (here
    given the wrong way round) are refused at the first row that shows it, not trained on."""
    from lossmask import markers_from_strings
    from lossmask.vision import VisionCollator

    proc = processor(folders, "qwen2-vl")
    swapped = markers_from_strings(load_tokenizer(proc), response="<|im_start|>user\n",
                                   instruction="<|im_start|>assistant\n", end="<|im_end|>")
    rows = [{"messages": [{"role": "user", "content": [IMG, text("What is it?")]},
                          {"role": "assistant", "content": "A square."}], "images": [image(40, 40)]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "images": []}]
    with pytest.raises(ValueError, match=r"VisionCollator: row 0 of the batch: token \d+ lies in the text of message"
                                         r".*hf\.mask_dataset"):
        VisionCollator(proc, markers=swapped, check_roles="all")(rows)
    batch = VisionCollator(proc, check_roles="all")(rows)  # the processor's own markers keep it
    assert proc.tokenizer.decode(batch["input_ids"][1][batch["labels"][1] != -100]) == "Hello.<|im_end|>"
