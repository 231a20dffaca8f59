"""Video parts through a Qwen2-VL or Qwen2.5-VL processor: each video, a list of frames, is expanded as the processor
expands it, and none of its tokens ever trains.

The reference is the processor's own arithmetic: transformers' ``Qwen2VLVideoProcessor`` built from the same published
configuration, imported here with a stand-in ``torchvision`` module (its import needs one; counting tokens does not),
and the processor's ``_get_num_multimodal_tokens(video_sizes=...)`` and ``get_text_with_replacements``, as
``processor(text, videos=...)`` runs them. Labels are the rule written out here: assistant text trains through its
stop token, every token from ``<|vision_start|>`` to ``<|vision_end|>`` never does.
"""

from __future__ import annotations

import importlib
import json
import sys
import types

import numpy as np
import pytest

from conftest import vision_processor_dir

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from test_vision import folders, image, png, processor, text  # noqa: E402,F401 - the shared processor fixtures

from lossmask import hf, load_tokenizer, mask_files  # noqa: E402
from lossmask.chat.media import QWEN2_VL_VIDEO_DEFAULTS, load_processor, media_tokens  # noqa: E402

QWEN = ("qwen2-vl", "qwen2.5-vl")
VIDEO = {"type": "video"}
STUB = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional")


def video_processor_class():
    """transformers' ``Qwen2VLVideoProcessor``, its module imported over a stand-in torchvision; the stand-in and the
    module are then taken out of ``sys.modules`` again, so that no later load finds a video processor."""
    if "class" in _VIDEO_CLASS:
        return _VIDEO_CLASS["class"]
    import transformers.processing_utils  # noqa: F401 - imported first, so that torchvision is seen as missing
    import transformers.video_processing_utils  # noqa: F401

    package, name = "transformers.models.qwen2_vl", "video_processing_qwen2_vl"
    saved = {n: sys.modules.get(n) for n in (*STUB, f"{package}.{name}")}
    for n in STUB:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[STUB[-1]].InterpolationMode = type("InterpolationMode", (), {})
    try:
        _VIDEO_CLASS["class"] = importlib.import_module(f"{package}.{name}").Qwen2VLVideoProcessor
    finally:
        for n, module in saved.items():
            if module is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = module
        if saved[f"{package}.{name}"] is None and name in vars(sys.modules[package]):
            delattr(sys.modules[package], name)
    return _VIDEO_CLASS["class"]


_VIDEO_CLASS: dict = {}


def reference_processor(folder):
    """The processor class of ``folder`` with its video processor loaded from the folder by transformers."""
    import transformers

    with open(folder / "preprocessor_config.json", encoding="utf-8") as fh:
        cls = getattr(transformers, json.load(fh)["processor_class"])

    class WithVideo(cls):  # its class check looks the video processor up in a table that is empty without torchvision
        def check_argument_for_proper_class(self, name, arg):
            return type(arg) if name == "video_processor" else super().check_argument_for_proper_class(name, arg)

    from transformers import AutoImageProcessor, AutoTokenizer

    video = video_processor_class().from_pretrained(folder, local_files_only=True)
    return WithVideo(image_processor=AutoImageProcessor.from_pretrained(folder, local_files_only=True),
                     tokenizer=AutoTokenizer.from_pretrained(folder, local_files_only=True), video_processor=video,
                     chat_template=(folder / "chat_template.jinja").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, folders):  # noqa: F811
    out = tmp_path_factory.mktemp("video")
    made = {"qwen2-vl": folders["qwen2-vl"], "qwen2.5-vl": vision_processor_dir("qwen2.5-vl", out)}
    return {family: (load_processor(folder), reference_processor(folder), folder) for family, folder in made.items()}


def frame_sizes(frames):
    from PIL import Image
    import io

    sizes = {Image.open(io.BytesIO(f)).size if isinstance(f, bytes) else f.size for f in frames}
    (w, h), = sizes
    return len(frames), h, w


def reference_ids(ref, messages, images, videos, **kwargs):
    """The processor's ids: its template, each ``<|video_pad|>`` replaced by the count its video processor gives the
    frames (and each image by its image step), tokenised by its tokenizer, as ``processor.__call__`` does."""
    rendered = ref.apply_chat_template(messages, tokenize=False)
    sizes = [frame_sizes(v) for v in videos]
    counts = ref._get_num_multimodal_tokens(video_sizes=sizes, **kwargs)["num_video_tokens"] if videos else []
    image_replacements = []
    if images:
        merged = ref._merge_kwargs(tokenizer_init_kwargs=ref.tokenizer.init_kwargs, **kwargs)
        image_replacements = ref._process_images(images, **merged["images_kwargs"])[1]
    (expanded,), _ = ref.get_text_with_replacements([rendered], image_replacements,
                                                    [ref.video_token * n for n in counts])
    return [int(i) for i in ref.tokenizer(expanded, add_special_tokens=False)["input_ids"]], counts


def reference_labels(tokens, ids):
    """The rule: after each ``<|im_start|>assistant`` and its newline, through ``<|im_end|>``, every token trains but
    those from a ``<|vision_start|>`` to its ``<|vision_end|>`` (an image's or a video's)."""
    labels = [-100] * len(ids)
    inside = media = False
    for k, token in enumerate(tokens):
        if token == "<|vision_start|>":
            media = True
        if inside and not media:
            labels[k] = ids[k]
        if token == "<|vision_end|>":
            media = False
        if token == "<|im_end|>":
            inside = False
        if k >= 2 and tokens[k - 2:k] == ["<|im_start|>", "assistant"] and token.startswith("Ċ"):
            inside = True
    return labels


def check_rows(family, qwen, rows, **options):
    """lossmask's ids and labels on ``rows`` (messages, images, videos), with the processor's and the rule's."""
    proc, ref, _ = qwen[family]
    kwargs = options.get("processor_kwargs") or {}
    ds = datasets.Dataset.from_list([{"messages": m, "images": i} for m, i, _ in rows])
    out, report = hf.mask_dataset(ds, proc, return_report=True, keep_dropped=True, quiet=True, **options)
    assert report.rows_out == len(rows), report.invalid_examples
    for (messages, images, videos), got in zip(rows, out):
        bare = [{**m, "content": [{"type": "video"} if p.get("type") == "video" else p for p in m["content"]]}
                for m in messages]
        ids, counts = reference_ids(ref, bare, images, videos, **kwargs)
        assert got["input_ids"] == ids
        tokens = ref.tokenizer.convert_ids_to_tokens(ids)
        assert tokens.count("<|video_pad|>") == sum(counts) > 0
        assert got["labels"] == reference_labels(tokens, ids)
        trained = {ids[k] for k, label in enumerate(got["labels"]) if label != -100}
        assert not trained & set(ref.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>",
                                                                      "<|video_pad|>", "<|image_pad|>"]))
    return out, report


def video_chat(frames, where="user"):
    clip = {"type": "video", "video": frames}
    if where == "user":
        return [{"role": "user", "content": [clip, text("What happens?")]},
                {"role": "assistant", "content": [text("A square stays still.")]}]
    return [{"role": "user", "content": [text("Show me a clip.")]},
            {"role": "assistant", "content": [text("Here:"), clip, text("It is red.")]}]


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


SIZES = {"tiny": (20, 15), "photo": (600, 400), "strip": (30, 900)}


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("where", ["user", "assistant"])
def test_video_frames_expand_as_the_processor_counts_them(qwen, family, where):
    frames = {name: png(w, h) for name, (w, h) in SIZES.items()}
    rows = []
    for name in SIZES:
        for n in (1, 2, 3, 8):
            clip = [frames[name]] * n
            rows.append((video_chat(clip, where), [], [clip]))
    out, _ = check_rows(family, qwen, rows)
    proc = qwen[family][0]
    trained = proc.tokenizer.decode([i for i, label in zip(out[0]["input_ids"], out[0]["labels"]) if label != -100])
    assert trained == ("A square stays still.<|im_end|>" if where == "user" else "Here:It is red.<|im_end|>")


@pytest.mark.parametrize("family", QWEN)
def test_frames_over_max_pixels_are_shrunk_as_the_processor_shrinks_them(qwen, family):
    big = png(4000, 3300)  # 13.2 million pixels: over the published max_pixels (12,845,056)
    rows = [(video_chat([big] * n), [], [[big] * n]) for n in (1, 2)]
    check_rows(family, qwen, rows)
    small = png(600, 400)
    check_rows(family, qwen, [(video_chat([small] * 3), [], [[small] * 3])], processor_kwargs={"max_pixels": 50000})


@pytest.mark.parametrize("family", QWEN)
def test_video_and_images_in_one_row_expand_in_the_order_the_template_writes_them(qwen, family):
    clip, other = [png(600, 400)] * 3, [png(30, 900, (0, 0, 200))] * 2
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video", "video": clip}, text("Compare.")]},
                {"role": "assistant", "content": [text("The picture is red;"), {"type": "video", "video": other},
                                                  text("this one is blue.")]},
                {"role": "user", "content": [text("And this?"), {"type": "image"}]},
                {"role": "assistant", "content": [text("Green.")]}]
    images = [image(64, 48), image(50, 50, (0, 200, 0))]
    out, report = check_rows(family, qwen, [(messages, images, [clip, other])])
    proc = qwen[family][0]
    got = out[0]
    trained = proc.tokenizer.decode([i for i, label in zip(got["input_ids"], got["labels"]) if label != -100])
    assert trained == "The picture is red;this one is blue.<|im_end|>Green.<|im_end|>"
    media = set(media_tokens(load_tokenizer(proc)).ids)
    assert report.media_tokens == sum(i in media for i in got["input_ids"])


def test_videos_may_come_in_a_videos_column_and_as_frame_paths(qwen, tmp_path):
    proc, ref, _ = qwen["qwen2-vl"]
    for k in range(3):
        (tmp_path / f"f{k}.png").write_bytes(png(600, 400, (10 * k, 0, 0)))
    paths = [f"f{k}.png" for k in range(3)]
    placeholder = [{"role": "user", "content": [VIDEO, text("What happens?")]},
                   {"role": "assistant", "content": [text("A square stays still.")]}]
    inline = video_chat(paths)
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps({"messages": placeholder, "videos": [paths]}) + "\n"
                      + json.dumps({"messages": inline}) + "\n")
    report = mask_files(source, tmp_path / "out.parquet", tokenizer=qwen["qwen2-vl"][2], progress=False)
    assert report.rows_out == 2
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out.parquet")
    ids = table.column("input_ids").to_pylist()
    want, _ = reference_ids(ref, placeholder, [], [[png(600, 400)] * 3])
    assert ids == [want, want]
    assert table.column("labels").to_pylist()[0] == reference_labels(ref.tokenizer.convert_ids_to_tokens(want), want)


def test_video_settings_missing_from_the_config_are_the_video_processors_own(qwen, tmp_path):
    cls = video_processor_class()
    for name, value in QWEN2_VL_VIDEO_DEFAULTS.items():
        assert getattr(cls, name) == value, name
    import shutil

    folder = tmp_path / "bare-video-config"
    shutil.copytree(qwen["qwen2-vl"][2], folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2VLProcessor"}))
    mine = {"qwen2-vl": (load_processor(folder), reference_processor(folder), folder)}
    assert getattr(mine["qwen2-vl"][0], "video_processor", None) is None  # the stand-in left nothing behind
    assert mine["qwen2-vl"][1].video_processor.size.shortest_edge == 128 * 28 * 28  # the class's, not the images'
    rows = [(video_chat([png(w, h)] * n), [], [[png(w, h)] * n]) for (w, h) in SIZES.values() for n in (1, 3)]
    check_rows("qwen2-vl", mine, rows)


def test_a_per_frame_pixel_cap_in_the_config_is_applied(qwen, tmp_path):
    """``cap_pixels_per_frame``: each frame gets at most an even share of ``max_video_tokens``' worth of pixels. Written
    out for eight 600x400 frames, max_video_tokens=1000: a budget of int(1000 * 28 * 28 * 0.9) = 705,600 pixels,
    2 * 705,600 // 8 = 176,400 per frame; 600x400 (240,000) scales by sqrt(240000 / 176400) to 336x504 (a multiple of
    28), 24x36 patches per frame pair, four pairs: 3,456 patches, 864 tokens."""
    import shutil

    folder = tmp_path / "capped"
    shutil.copytree(qwen["qwen2-vl"][2], folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen2VLVideoProcessor", "min_pixels": 3136, "max_pixels": 12845056,
         "cap_pixels_per_frame": True, "max_video_tokens": 1000}))
    ds = datasets.Dataset.from_list([{"messages": video_chat([png(600, 400)] * 8)}])
    capped = load_processor(folder)
    (row,) = hf.mask_dataset(ds, capped, quiet=True)
    assert row["input_ids"].count(capped.tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 864


def test_unusable_videos_are_invalid_and_named(qwen, tmp_path):
    a, b = data_url(png(600, 400)), data_url(png(40, 30))
    broken = "data:image/png;base64,AAAA"
    rows = [video_chat([a, a]), video_chat("clip.mp4"), video_chat([a, b]), video_chat([a, broken]),
            [{"role": "user", "content": [VIDEO, text("What?")]}, {"role": "assistant", "content": [text("No.")]}],
            video_chat([a] * 8)]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    report = mask_files(source, tmp_path / "out.parquet", tokenizer=qwen["qwen2-vl"][2], progress=False,
                        max_drop_fraction=1.0, max_media_tokens=1000)
    assert report.rows_out == 1 and report.dropped["invalid"] == 5
    examples = " ".join(report.invalid_examples)
    assert "line 2): video 0 is a file ('clip.mp4'); lossmask decodes no video file" in examples
    assert "line 3): video 0: its frames are not all one size" in examples
    assert "line 4): video 0 frame 1 cannot be opened" in examples
    assert "line 5): video 0: a video part has no video" in examples
    assert "line 6): its images and videos make 1,176 media tokens, over max_media_tokens=1,000" in examples


@pytest.mark.parametrize("family", ["gemma-3", "idefics3", "llava"])
def test_processors_without_video_expansion_refuse_video_rows(folders, family):  # noqa: F811
    proc = processor(folders, family)
    rows = [video_chat([png(64, 48)] * 2),
            [{"role": "user", "content": [text("Hi")]}, {"role": "assistant", "content": [text("Hello.")]}]]
    ds = datasets.Dataset.from_list([{"messages": m} for m in rows])
    from lossmask import markers_from_strings

    markers = markers_from_strings(load_tokenizer(proc), response="ASSISTANT:", instruction="USER:") \
        if family == "llava" else None
    _, report = hf.mask_dataset(ds, proc, markers, return_report=True, quiet=True, max_drop_fraction=1.0)
    assert report.rows_out == 1 and report.dropped["invalid"] == 1
    assert "row 0: a 'video' part: lossmask expands images only for a" in report.invalid_examples[0]


def test_the_vision_collator_refuses_a_video_row_in_one_line(qwen):
    from lossmask.vision import VisionCollator

    collator = VisionCollator(qwen["qwen2-vl"][0])
    with pytest.raises(ValueError, match="row 0 of the batch has a video; video rows need transformers' video "
                                         r"processor .* which needs torchvision \(pip install torchvision"):
        collator([{"messages": video_chat([png(64, 48)] * 2)}])
    plain = [{"role": "user", "content": [text("Hi")]}, {"role": "assistant", "content": [text("Hello.")]}]
    assert np.asarray(collator([{"messages": plain}])["labels"]).size  # rows without a video still pass
