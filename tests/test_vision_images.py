"""Images as the processor sees them: EXIF orientation, alpha and other modes, where a path is read from, the bounds
on one image and on one row, per-call processor options (Gemma-3's pan-and-scan), LLaVA's template text around an
image, and the MLX feed's refusal of image rows.

Ground truth is the processor's own output on the image as ``datasets`` and transformers' ``load_image`` open it (the
EXIF orientation applied, the mode kept): its ``input_ids``, its ``pixel_values``, and labels written from the rule
(assistant text trains; every token of an image's expansion, and the template's text around it, never trains).
"""

from __future__ import annotations

import io
import json
import os
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from PIL import Image, ImageOps  # noqa: E402

from lossmask import hf, load_tokenizer, mask_files  # noqa: E402
from lossmask.chat.media import MediaDetectionError, load_processor, media_tokens  # noqa: E402
from test_vision import IMG, folders, processor, processor_ids, reference_labels, text  # noqa: E402,F401

from conftest import vision_processor_dir  # noqa: E402

ASSISTANT_IMAGE = "assistant"


def photo(w, h, mode="RGB"):
    """A small image with structure (a gradient and a block), so that a turn, a flip or a lost channel shows."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1).astype(np.uint8)
    rgb[: h // 3, : w // 4] = (250, 20, 20)
    image = Image.fromarray(rgb, "RGB")
    if mode in ("RGBA", "LA"):
        alpha = ((x * 255) // max(w - 1, 1)).astype(np.uint8)  # semi-transparent, left to right
        image.putalpha(Image.fromarray(alpha, "L"))
        image = image.convert(mode)
    elif mode == "P":  # a palette with one transparent entry
        image = image.quantize(16)
        image.info["transparency"] = 0
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def encoded(image, fmt="PNG", orientation=None) -> bytes:
    buffer = io.BytesIO()
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif
    if image.mode == "P" and "transparency" in image.info:
        kwargs["transparency"] = image.info["transparency"]
    image.save(buffer, format=fmt, **kwargs)
    return buffer.getvalue()


def as_datasets_opens(data: bytes):
    """The image as the ``datasets`` Image feature (and ``load_image``, less its RGB conversion) gives it."""
    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image)


def chat(where="user"):
    if where == ASSISTANT_IMAGE:
        return [{"role": "user", "content": [text("Show me.")]},
                {"role": "assistant", "content": [IMG, text("Here it is.")]}]
    return [{"role": "user", "content": [IMG, text("What is it?")]},
            {"role": "assistant", "content": [text("A photo.")]}]


def test_exif_orientation_is_applied_to_paths_bytes_and_image_structs(folders, tmp_path):
    """Idefics3 splits a 728x364 image into one row of two tiles and its turned form into two rows of one: the ids
    name the tiles (<row_1_col_2> against <row_2_col_1>), so an orientation left out writes other ids."""
    proc = processor(folders, "idefics3")
    data = encoded(photo(364, 728), orientation=6)  # stored upright 364x728, shown turned: 728x364
    path = tmp_path / "turned.png"
    path.write_bytes(data)
    messages = chat()
    truth = processor_ids(proc, messages, [as_datasets_opens(data)])
    assert truth != processor_ids(proc, messages, [Image.open(io.BytesIO(data))])  # the orientation matters here
    for form in (str(path), data, {"bytes": data, "path": None}, {"bytes": None, "path": str(path)}):
        (got,) = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [messages], "images": [[form]]}), proc,
                                 quiet=True)
        assert got["input_ids"] == truth
        tokens = proc.tokenizer.convert_ids_to_tokens(truth)
        assert got["labels"] == reference_labels("idefics3", truth, tokens).tolist()


# the families whose fixtures test_vision.folders does not build: made here, once per module
MORE_FAMILIES = ("qwen2.5-vl", "llava-next", "idefics3-1456", "smolvlm", "mllama")


@pytest.fixture(scope="module")
def all_folders(folders, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision-more")
    return {**folders, **{family: vision_processor_dir(family, out) for family in MORE_FAMILIES}}


def sixteen_bit(image):
    """``image`` as a 16-bit grayscale (``I;16``) image, its full range used."""
    return Image.fromarray(np.asarray(image.convert("L"), dtype=np.uint16) * 257)


def llava_markers(proc):
    from lossmask import markers_from_strings

    return markers_from_strings(load_tokenizer(proc), response="ASSISTANT:", instruction="USER:")


# what each family's processor returns beside input_ids, for one batch of images
PIXEL_FIELDS = {"qwen2-vl": ("pixel_values", "image_grid_thw"), "idefics3": ("pixel_values", "pixel_attention_mask"),
                "llava-next": ("pixel_values", "image_sizes")}


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "CMYK", "L", "I;16", "EXIF"])
@pytest.mark.parametrize("family", list(PIXEL_FIELDS))
def test_collator_pixels_equal_the_processors_for_every_image_mode(all_folders, family, mode):
    """Alpha is composited onto white by the processor itself (a semi-transparent image's hidden colour never shows);
    palette, CMYK, grayscale and 16-bit images are converted by it; an EXIF-turned image is turned first. The fields
    that say where the pixels go (Qwen2-VL's grid, Idefics3's pixel mask, LLaVA-Next's image sizes) are the
    processor's too."""
    import torch

    from lossmask.vision import VisionCollator

    proc = processor(all_folders, family)
    if mode == "EXIF":
        data = encoded(photo(56, 112), orientation=8)
        given, truth = data, as_datasets_opens(data)
    elif mode == "CMYK":
        data = encoded(photo(112, 56, "CMYK"), fmt="JPEG")
        given, truth = data, as_datasets_opens(data)
    elif mode == "I;16":
        data = encoded(sixteen_bit(photo(112, 56)))
        given, truth = data, as_datasets_opens(data)
        assert truth.mode == "I;16"
    else:
        given = truth = photo(112, 56, mode)
    messages = chat()
    markers = llava_markers(proc) if family == "llava-next" else None
    batch = VisionCollator(proc, markers=markers)([{"messages": messages, "images": [given]}])
    rendered = proc.apply_chat_template(messages, tokenize=False)
    theirs = proc(text=[rendered], images=[[truth]], add_special_tokens=False, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == theirs["input_ids"][0].tolist()
    for field in PIXEL_FIELDS[family]:
        assert torch.equal(batch[field], theirs[field]), field


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def path_row(image_path):
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image_path}, text("What is it?")]},
                         {"role": "assistant", "content": [text("A photo.")]}]}


def test_relative_image_paths_are_read_from_the_data_files_folder_or_media_dir(folders, tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from lossmask.cli import main

    data = tmp_path / "data"
    (data / "img").mkdir(parents=True)
    (data / "img" / "a.png").write_bytes(encoded(photo(64, 48)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the current folder holds no image
    source = write_rows(data / "chats.jsonl", [path_row("img/a.png")])
    report = mask_files(source, tmp_path / "out.parquet", tokenizer=folders["qwen2-vl"], progress=False)
    assert report.rows_out == 1 and report.media_tokens > 0
    # a media folder apart from the data (datasets' and LLaMA-Factory's layout): --media-dir / media_dir
    media = tmp_path / "media"
    (media / "img").mkdir(parents=True)
    (media / "img" / "b.png").write_bytes(encoded(photo(64, 48)))
    source = write_rows(tmp_path / "other" / "chats.jsonl", [path_row("img/b.png")])
    assert main(["mask", str(source), str(tmp_path / "out2.parquet"), "--tokenizer", str(folders["qwen2-vl"]),
                 "--media-dir", str(media), "--no-progress"]) == 0
    assert pq.read_table(tmp_path / "out2.parquet").num_rows == 1
    # absolute paths are read as they are
    report = mask_files(write_rows(tmp_path / "abs" / "chats.jsonl", [path_row(str(media / "img" / "b.png"))]),
                        tmp_path / "out3.parquet", tokenizer=folders["qwen2-vl"], progress=False)
    assert report.rows_out == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_an_image_path_that_is_not_a_regular_file_is_invalid_and_never_read(folders, tmp_path):
    os.mkfifo(tmp_path / "pipe.png")  # opening it would wait for a writer forever
    (tmp_path / "folder.png").mkdir()
    rows = [path_row("pipe.png"), path_row("folder.png"), path_row("missing.png")]
    report = mask_files(write_rows(tmp_path / "chats.jsonl", rows), tmp_path / "out.parquet",
                        tokenizer=folders["qwen2-vl"], progress=False, max_drop_fraction=1.0)
    assert report.dropped["invalid"] == 3
    examples = " ".join(report.invalid_examples)
    assert "pipe.png' is not a regular file" in examples and "folder.png' is not a regular file" in examples
    assert "missing.png" in examples and "FileNotFoundError" in examples


def png_header(width, height) -> bytes:
    """A PNG that says it is ``width`` x ``height`` and holds one row: refused from its header, never decoded."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * (width + 1)))
            + chunk(b"IEND", b""))


def test_an_image_over_max_image_pixels_is_invalid_from_its_header(folders):
    proc = processor(folders, "qwen2-vl")
    rows = {"messages": [chat(), chat(), chat()],
            "images": [[png_header(12000, 12000)], [encoded(photo(64, 48))], [encoded(photo(64, 48))]]}
    out, report = hf.mask_dataset(datasets.Dataset.from_dict(rows), proc, return_report=True, quiet=True,
                                  max_drop_fraction=1.0)
    assert report.rows_out == 2 and report.dropped["invalid"] == 1
    assert "row 0: image 0 is 12000x12000, 144,000,000 pixels, over max_image_pixels=50,000,000" in \
        report.invalid_examples[0]
    _, report = hf.mask_dataset(datasets.Dataset.from_dict(rows), proc, return_report=True, quiet=True,
                                max_drop_fraction=1.0, max_image_pixels=1000)
    assert report.rows_out == 0 and report.dropped["invalid"] == 3


def test_a_row_over_max_media_tokens_is_invalid_before_its_pixels_are_made(folders):
    """The processor's own count from the image sizes is read before its image step runs: a ``min_pixels`` of 1e12
    would make each 64x64 image a trillion pixels."""
    proc = processor(folders, "qwen2-vl")
    rows = {"messages": [chat()] * 2, "images": [[encoded(photo(64, 64))]] * 2}
    _, report = hf.mask_dataset(datasets.Dataset.from_dict(rows), proc, return_report=True, quiet=True,
                                max_drop_fraction=1.0, processor_kwargs={"min_pixels": 10 ** 12})
    assert report.dropped["invalid"] == 2 and "over max_media_tokens=65,536" in report.invalid_examples[0]
    big = {"messages": [chat()], "images": [[encoded(photo(200, 200))]]}  # 49 image tokens
    _, report = hf.mask_dataset(datasets.Dataset.from_dict(big), proc, return_report=True, quiet=True,
                                max_drop_fraction=1.0, max_media_tokens=20)
    assert report.dropped["invalid"] == 1
    assert "its images make 49 image tokens, over max_media_tokens=20" in report.invalid_examples[0]


def test_a_processor_config_that_blows_every_image_up_is_refused_at_setup(folders, tmp_path):
    import shutil

    folder = tmp_path / "huge"
    shutil.copytree(folders["qwen2-vl"], folder)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config.update(min_pixels=10 ** 12, max_pixels=10 ** 13)
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(MediaDetectionError, match="image tokens for a 56x56 probe image"):
        media_tokens(load_tokenizer(folder))


@pytest.mark.parametrize("where", ["user", ASSISTANT_IMAGE])
def test_processor_kwargs_reach_every_processor_call_and_pan_and_scan_text_never_trains(folders, where):
    """Gemma-3's pan-and-scan writes the whole image and its crops, with text between them ("Here is the original
    image ... and here it is cropped"): its ids are the processor's with the same keyword, and none of it trains."""
    from lossmask.vision import VisionCollator

    proc = processor(folders, "gemma-3")
    image = photo(600, 400)
    messages = chat(where)
    rendered = proc.apply_chat_template(messages, tokenize=False)
    theirs = proc(text=[rendered], images=[[image]], add_special_tokens=False, do_pan_and_scan=True)
    truth = [int(i) for i in theirs["input_ids"][0]]
    assert len(truth) > len(processor_ids(proc, messages, [image])) + 256  # crops were made
    answer = "Here it is.<end_of_turn>" if where == ASSISTANT_IMAGE else "A photo.<end_of_turn>"
    ds = datasets.Dataset.from_dict({"messages": [messages], "images": [[encoded(image)]]})
    (got,) = hf.mask_dataset(ds, proc, quiet=True, processor_kwargs={"do_pan_and_scan": True})
    assert got["input_ids"] == truth
    assert proc.tokenizer.decode([i for i, lab in zip(got["input_ids"], got["labels"]) if lab != -100]) == answer
    collator = VisionCollator(proc, processor_kwargs={"do_pan_and_scan": True})
    batch = collator([{"messages": messages, "images": [image]}])
    assert batch["input_ids"][0].tolist() == truth
    assert np.array_equal(batch["pixel_values"].numpy(), np.asarray(theirs["pixel_values"]))
    trained = batch["input_ids"][0][batch["labels"][0] != -100].tolist()
    assert proc.tokenizer.decode(trained) == answer


def test_processor_kwargs_are_read_from_the_command_line_form():
    from lossmask import MaskOptions

    options = MaskOptions(processor_kwargs="do_pan_and_scan=true,max_pixels=1003520,resample=bicubic")
    assert options.processor_call_kwargs() == {"do_pan_and_scan": True, "max_pixels": 1003520, "resample": "bicubic"}
    with pytest.raises(ValueError, match="processor_kwargs"):
        MaskOptions(processor_kwargs="do_pan_and_scan")


def test_llava_with_given_markers_never_trains_the_template_text_around_an_image(folders):
    """LLaVA-1.5's template writes ``ASSISTANT: <image>\\n``: the space before the image and the newline after it
    are the image part's, not the answer's."""
    from lossmask import markers_from_strings

    proc = processor(folders, "llava")
    markers = markers_from_strings(load_tokenizer(proc), response="ASSISTANT:", instruction="USER:")
    messages = chat(ASSISTANT_IMAGE)
    (got,) = hf.mask_dataset(datasets.Dataset.from_dict({"messages": [messages], "images": [[encoded(photo(40, 40))]]}),
                             proc, markers=markers, quiet=True)
    assert got["input_ids"] == processor_ids(proc, messages, [photo(40, 40)])
    trained = [i for i, lab in zip(got["input_ids"], got["labels"]) if lab != -100]
    assert proc.tokenizer.convert_ids_to_tokens(trained)[0] == "Here"
    assert proc.tokenizer.decode(trained) == "Here it is. "


MLX_PLAIN = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
# a second row carrying media in one of the forms users have, and what the one-line refusal says of it
MLX_MEDIA_ROWS = {
    "llama-factory video": (MLX_PLAIN, {"messages": [{"role": "user", "content": "<video>What happens?"},
                                                     {"role": "assistant", "content": "A cat jumps."}],
                                        "videos": [["f0.png", "f1.png"]]}, r"media in its 'videos' column"),
    "llama-factory image": (MLX_PLAIN, {"messages": [{"role": "user", "content": "<image>What is it?"},
                                                     {"role": "assistant", "content": "A photo."}],
                                        "images": ["a.png"]}, r"media in its 'images' column"),
    "prompt/completion": ({"prompt": "Hi", "completion": "Hello."},
                          {"prompt": "<image>What is it?", "completion": "A photo.", "images": ["a.png"]},
                          r"media in its 'images' column"),
    "text": ({"text": "Hello."}, {"text": "<image>A photo.", "images": ["a.png"]}, r"media in its 'images' column"),
    "typed vision tokens": (MLX_PLAIN, {"messages": [
        {"role": "user", "content": "Hi <|vision_start|><|image_pad|><|vision_end|> what?"},
        {"role": "assistant", "content": "Hello."}]},
        r"the media token '<\|vision_start\|>' \(id 151652\) at position \d+"),
    "tokenised rows": ({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
                       {"input_ids": [1, 151652, 151655, 151655, 151653, 2], "labels": [-100] * 5 + [2]},
                       r"the media token '<\|vision_start\|>' \(id 151652\) at position 1"),
}


@pytest.mark.filterwarnings("ignore:.*has no valid.jsonl:UserWarning")
@pytest.mark.parametrize("case", sorted(MLX_MEDIA_ROWS))
def test_the_mlx_feed_refuses_every_row_carrying_media_naming_it(tmp_path, case):
    """Media in any form, on any row shape, is refused in one line naming the row: an ``images`` or ``videos`` column
    (LLaMA-Factory's ``<image>`` / ``<video>`` rows, prompt/completion and text rows), vision tokens typed in a
    message (a text template leaves them tokens), and media tokens in tokenised rows."""
    pytest.importorskip("mlx.core")
    from lossmask import mlx as lm

    from conftest import tokenizer_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path("qwen2.5"))
    plain, carrying, said = MLX_MEDIA_ROWS[case]
    write_rows(tmp_path / "d" / "train.jsonl", [plain, carrying])
    masked = "messages" in plain
    with pytest.raises(ValueError, match=r"^\S*train.jsonl row 1 holds " + said + r".*the MLX feed trains text models"
                                         r"[^\n]*VisionCollator\)$"):
        lm.load_dataset(tmp_path / "d", tok, mask_prompt=masked)


@pytest.mark.filterwarnings("ignore:.*has no valid.jsonl:UserWarning")
def test_the_mlx_feed_refuses_mask_output_of_an_image_row_and_keeps_html_img_text(folders, tmp_path):
    """``lossmask mask`` output of an image row (its ``<|image_pad|>`` tokens, no pixels) used as ``train.parquet``
    is refused, naming the row; Gemma's ``<img>`` HTML token is vocabulary, not media: a row typing it loads."""
    pytest.importorskip("mlx.core")
    from lossmask import mlx as lm

    from conftest import tokenizer_path
    from transformers import AutoTokenizer

    source = tmp_path / "chats.jsonl"
    pictured = {"messages": [{"role": "user", "content": [IMG, text("What is it?")]},
                             {"role": "assistant", "content": [text("A photo.")]}],
                "images": [str(tmp_path / "a.png")]}
    photo(56, 56).save(tmp_path / "a.png")
    plain = {"messages": [{"role": "user", "content": [text("Hi")]}, {"role": "assistant", "content": [text("Hello.")]}]}
    write_rows(source, [plain, pictured])
    (tmp_path / "d").mkdir()
    mask_files(str(source), str(tmp_path / "d" / "train.parquet"), tokenizer=str(folders["qwen2-vl"]), progress=False)
    tok = AutoTokenizer.from_pretrained(tokenizer_path("qwen2.5"))
    with pytest.raises(ValueError, match=r"train.parquet row 1 holds the media token '<\|vision_start\|>'"):
        lm.load_dataset(tmp_path / "d", tok, mask_prompt=False)
    gemma = AutoTokenizer.from_pretrained(tokenizer_path("gemma-3"))
    write_rows(tmp_path / "g" / "train.jsonl", [{"text": "An <img> tag shows a photo."}] * 2)
    (train, _, _) = lm.load_dataset(tmp_path / "g", gemma, mask_prompt=False)
    assert gemma.convert_tokens_to_ids("<img>") in train[0][0]


@pytest.mark.filterwarnings("ignore:.*has no valid.jsonl:UserWarning")
def test_the_mlx_feed_refuses_image_rows_naming_the_row(tmp_path):
    pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    import lossmask
    from lossmask import mlx as lm

    from conftest import tokenizer_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    pictured = {"messages": [{"role": "user", "content": [IMG, text("What is it?")]},
                             {"role": "assistant", "content": "A photo."}]}
    folder = tmp_path / "d"
    write_rows(folder / "train.jsonl", [plain, pictured])
    with pytest.raises(ValueError, match=r"train.jsonl row 1 holds an? 'image' part; the MLX feed trains text models"):
        lm.load_dataset(folder, tok, markers=lossmask.detect_markers(tok))


def test_cross_attention_mask_is_the_mllama_processors_on_any_layout():
    """``vision.cross_attention_mask`` (NumPy over the batch) against transformers' own, row by row: images at the
    start, the end, side by side, apart, padding on either side, and rows without images."""
    pytest.importorskip("torch")
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                               get_cross_attention_token_mask)

    from lossmask.vision import cross_attention_mask

    rng = np.random.default_rng(0)
    image = 9
    for _ in range(200):
        rows, width = int(rng.integers(1, 5)), int(rng.integers(1, 12))
        ids = rng.integers(0, 9, size=(rows, width))
        ids[rng.random((rows, width)) < rng.random()] = image
        if (ids == image).sum() == 0:
            continue
        tiles = [[int(t) for t in rng.integers(1, 5, size=int((r == image).sum()))] for r in ids]
        sparse = [get_cross_attention_token_mask(r.tolist(), image) for r in ids]
        want = convert_sparse_cross_attention_mask_to_dense(sparse, num_tiles=tiles, max_num_tiles=4, length=width)
        np.testing.assert_array_equal(cross_attention_mask(ids, image, tiles, 4), want)


def test_a_tiny_mllama_reads_the_collators_cross_attention_mask(all_folders):
    """On a tiny random Mllama with its cross-attention gates open, the loss on the collator's batch is the loss on the
    processor's own fields (the collator's labels beside them), and leaving ``cross_attention_mask`` out changes it:
    the text before the image would see it."""
    import torch
    import transformers

    from lossmask.vision import VisionCollator

    proc = processor(all_folders, "mllama")
    messages = [{"role": "user", "content": [text("Before the image"), IMG, text("What is it?")]},
                {"role": "assistant", "content": [text("A photo.")]}]
    image = photo(112, 56)
    batch = VisionCollator(proc)([{"messages": messages, "images": [image]}])
    theirs = proc(text=[proc.apply_chat_template(messages, tokenize=False)], images=[[image]],
                  add_special_tokens=False, return_tensors="pt")
    torch.manual_seed(0)
    config = transformers.MllamaConfig(
        text_config=dict(vocab_size=128257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, cross_attention_layers=[1],
                         max_position_embeddings=512),
        vision_config=dict(image_size=560, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_global_layers=1, attention_heads=2, intermediate_layers_indices=[0],
                           vision_output_dim=64, max_num_tiles=4),
        image_token_index=128256)
    model = transformers.MllamaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "gate" in name:  # zero at init: the image would reach no token
                weight.fill_(1.0)
        ours = model(**batch).loss.item()
        processors = model(**dict(theirs), labels=batch["labels"]).loss.item()
        unmasked = model(**{k: v for k, v in batch.items() if k != "cross_attention_mask"}).loss.item()
    assert ours == processors
    assert abs(ours - unmasked) > 1e-5


TYPED_FAMILIES = ("qwen2-vl", "gemma-3", "mllama", "llava", "idefics3")


@pytest.mark.parametrize("family", TYPED_FAMILIES)
def test_a_placeholder_typed_in_message_text_is_invalid_and_named_through_every_processor(all_folders, family):
    """``<image>`` typed in a message's text, as a string content or a text part, with images given or without: the
    same refusal through every processor, whether ``<image>`` is its placeholder (LLaVA, Idefics3) or not (Qwen2-VL,
    Gemma-3, Mllama); so is the text of the processor's own media tokens. A string content whose ``<image>`` stands
    where each image of the row's ``images`` column goes is LLaMA-Factory's form, read as parts. The rows beside them
    are labelled, and the collator raises naming the row."""
    from lossmask.chat.media import media_token_ids
    from lossmask.vision import VisionCollator

    proc = processor(all_folders, family)
    markers = llava_markers(proc) if family == "llava" else None
    own = media_token_ids(load_tokenizer(proc))
    typed_own = sorted(own.values())[0]
    answer = {"role": "assistant", "content": "A photo."}
    pictured = [encoded(photo(40, 40))]
    parts = [  # content parts, then string contents (one Arrow column holds one of the two)
        ([{"role": "user", "content": [IMG, text("What is it?")]},
          {"role": "assistant", "content": [text("A photo.")]}], pictured, None),
        ([{"role": "user", "content": [IMG, text("Is <image> the picture?")]},
          {"role": "assistant", "content": [text("Yes.")]}], pictured, "<image>"),
    ]
    strings = [
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], [], None),
        ([{"role": "user", "content": "<image>What is it?"}, answer], pictured, None),  # LLaMA-Factory's form
        ([{"role": "user", "content": "What does <image> mean in HTML?"}, answer], [], "<image>"),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Say {typed_own}"}, answer], [],
         typed_own),
    ]
    for rows in (parts, strings):
        ds = datasets.Dataset.from_dict({"messages": [m for m, _, _ in rows], "images": [i for _, i, _ in rows]})
        out, report = hf.mask_dataset(ds, proc, markers=markers, return_report=True, quiet=True, max_drop_fraction=1.0)
        refused = [r for r, (_, _, typed) in enumerate(rows) if typed is not None]
        assert len(out) == len(rows) - len(refused) and report.dropped["invalid"] == len(refused), report.summary()
        for r in refused:
            messages, _, typed = rows[r]
            message = next(i for i, m in enumerate(messages) if m["role"] == "user")
            line = f"row {r}: message {message} (user) types the media placeholder {typed!r} in its text"
            assert any(example.startswith(line) for example in report.invalid_examples), (line, report.invalid_examples)
    batch = [{"messages": m, "images": [photo(40, 40)] * len(i)} for m, i, _ in strings[:3]]
    assert VisionCollator(proc, markers=markers)(batch[:2])["input_ids"].shape[0] == 2  # LLaMA-Factory's row is read
    with pytest.raises(ValueError, match=r"row 2: message 0 \(user\) types the media placeholder '<image>'"):
        VisionCollator(proc, markers=markers)(batch)
