"""Chats with images: the processor's expansion of each image, and which tokens are media.

A vision-language model's processor owns two things a text tokenizer does not:

- the chat template writes a short *media part* for each image part of a message (Qwen2-VL:
  ``<|vision_start|><|image_pad|><|vision_end|>``; Gemma-3: ``<start_of_image>``), holding the
  processor's placeholder (``processor.image_token``);
- the processor *expands* each placeholder into the image's tokens, a number that depends on the image
  (Qwen2-VL: ``<|image_pad|>`` once per merged patch group) or not (Gemma-3: 256 ``<image_soft_token>``
  between ``<start_of_image>`` and ``<end_of_image>``).

This module derives both from the processor, never from a list kept by hand (``media_tokens``: the
template's media part, read by rendering probes with and without an image, and the ids of every
special token the media part and the expansion write), checks that the template's image handling is
what the processor expects, and expands rendered rows with the processor's own replacement strings
(``expand_rows``), so that lossmask tokenises exactly the text the processor tokenises. Images are
opened here (paths, bytes, ``{"bytes", "path"}`` structs, PIL images, ``data:`` URLs; ``open_image``: EXIF
orientation applied, mode kept for the processor's own conversion, bounded in pixels); a web URL is never
fetched. Every bound is checked from the images' headers (``image_size``, ``estimated_tokens``) before any pixel is
decoded, and the rows that pass are decoded one bounded group of images at a time.

Through a Qwen2-VL or Qwen2.5-VL processor, a video part (a list of frames) is expanded too: its
``<|video_pad|>`` becomes as many copies as the video processor would make for those frames, counted
here from their sizes (``VideoGrid``: that video processor needs torchvision; counting does not).

Which tokens train is the marker rule's business (``markers``); the media ids found here are never
trained (``markers.media.with_media``: each is a one-token ``mask_out`` pattern).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from .locate import message_pieces
from .quoting import quoted, shortened

# where a content part carries its image, in the forms chat formats use
IMAGE_PART_KEYS = ("image", "path", "url", "image_url")
IMAGE_PART_TYPES = ("image", "image_url")
PROBE_TEXT = ("Qz7p1", "Qz7p2")


class MediaError(ValueError):
    """A row's image cannot be used (it cannot be opened, or it is a web URL given without the image)."""


class MediaDetectionError(ValueError):
    """The processor's chat template does not write its images as the processor expects."""


# -- loading a processor ---------------------------------------------------------------------------

def is_processor(obj: Any) -> bool:
    """A Hugging Face processor with an image processor and a tokenizer (what expands images)."""
    return (getattr(obj, "image_processor", None) is not None and getattr(obj, "tokenizer", None) is not None
            and not hasattr(obj, "convert_tokens_to_ids"))


def holds_processor(path: str | os.PathLike) -> bool:
    """Does a folder hold a processor (an image-processor config), not just a tokenizer?"""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, "preprocessor_config.json"))
                                    or os.path.isfile(os.path.join(path, "processor_config.json")))


def load_processor(path: str | os.PathLike) -> Any:
    """A processor from a folder, offline.

    ``AutoProcessor`` first. Some processors also load a video processor that needs torchvision
    (Qwen2-VL); where that import fails, the processor is built from its tokenizer and image processor
    alone (images need neither torchvision nor video), so that labelling works on a plain CPU install.
    """
    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    path = os.fspath(path)
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError as exc:
        missing = exc
    else:  # a folder whose template lives in tokenizer_config.json only: the processor renders with it too
        if getattr(processor, "chat_template", None) is None and getattr(processor, "tokenizer", None) is not None:
            processor.chat_template = processor.tokenizer.chat_template
        return processor
    configs = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if os.path.isfile(os.path.join(path, name)):
            with open(os.path.join(path, name), encoding="utf-8") as fh:
                configs = {**json.load(fh), **configs}
    name = configs.get("processor_class")
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise ImportError(f"could not load the processor in {path!r}: {missing}") from missing
    keep = [a for a in cls.get_attributes() if a in ("image_processor", "tokenizer")]

    class ImageOnly(cls):  # the same processor without its video (or audio) sub-processor
        @classmethod
        def get_attributes(klass):
            return keep

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__
    ImageOnly.video_settings = _video_config(path)  # what its video processor would be built from (videos)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    template = None
    for name in ("chat_template.jinja", "chat_template.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as fh:
                template = fh.read() if name.endswith(".jinja") else json.load(fh)["chat_template"]
            break
    extra = {k: v for k, v in configs.items() if k in _init_names(cls)}
    return ImageOnly(image_processor=image_processor, tokenizer=tokenizer, chat_template=template, **extra)


def _video_config(path: str) -> dict | None:
    """The settings a video processor is built from in ``path``, in transformers' order: the ``video_processor`` of
    ``processor_config.json``, else ``video_preprocessor_config.json``, else ``preprocessor_config.json``."""
    nested = os.path.join(path, "processor_config.json")
    if os.path.isfile(nested):
        with open(nested, encoding="utf-8") as fh:
            found = json.load(fh).get("video_processor")
        if isinstance(found, dict):
            return found
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as fh:
                return json.load(fh)
    return None


def _init_names(cls) -> set[str]:
    import inspect

    return {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "image_processor", "tokenizer",
                                                                                "video_processor", "chat_template")}


# -- images ------------------------------------------------------------------------------------------

def part_image(part: Any) -> Any:
    """The image a content part carries inline (None for an image part that is only a placeholder)."""
    if not isinstance(part, dict):
        return None
    for key in IMAGE_PART_KEYS:
        value = part.get(key)
        if isinstance(value, dict) and key == "image_url":
            value = value.get("url")
        if value is not None and not (key in ("path", "url") and part.get("type") not in IMAGE_PART_TYPES):
            return value
    return None


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in IMAGE_PART_TYPES or "image" in part or "image_url" in part)


def content_parts(messages: Sequence[Any]) -> Iterator[Any]:
    """Every content part of a chat's list contents, in the order the template writes them."""
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            yield from content


def image_parts(messages: Sequence[Any]) -> list[Any]:
    """The image parts of a chat, in the order the template writes them."""
    return [part for part in content_parts(messages) if is_image_part(part)]


def row_images(messages: Sequence[Any], given: Any) -> list[Any]:
    """A row's images: its ``images`` column when it holds some, else the images its parts carry inline."""
    if given is not None and not isinstance(given, (list, tuple)):
        given = [given]
    if given:
        return list(given)
    return [part_image(part) for part in image_parts(messages)]


def open_image(value: Any, *, index: int, media_dir: str | None = None, max_pixels: int | None = None,
               where: str | None = None) -> Any:
    """A PIL image from what a row holds, as the processor is to see it; ``MediaError`` naming the image when it cannot
    be used.

    An image opened here (a path, bytes, a ``{"bytes", "path"}`` struct, a ``data:`` URL) is turned as its EXIF
    orientation says, as transformers' ``load_image`` and the ``datasets`` Image feature do; a PIL image given is
    taken as it is. Its mode is kept (alpha, palette, CMYK...): the processor's own conversion (alpha composited onto
    white) makes the pixels. A relative path is read from ``media_dir`` (None: the current folder), and only a
    regular file is read (a FIFO or a device would block). An image of more than ``max_pixels`` pixels is refused
    from its header, before it is decoded. ``where`` names it in a message (default ``image {index}``)."""
    where = where or f"image {index}"  # the row is named by whoever reports it
    image, opened = _unread(value, media_dir, where)
    try:
        _check_pixels(image.size, max_pixels, where)
        image.load()
        if opened and image.getexif().get(EXIF_ORIENTATION, 1) != 1:
            from PIL import ImageOps

            image = ImageOps.exif_transpose(image)
    except MediaError:
        raise
    except Exception as exc:  # truncated or corrupt pixels
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc})") from None
    return image


def image_size(value: Any, *, index: int, media_dir: str | None = None, max_pixels: int | None = None,
               where: str | None = None) -> tuple[int, int]:
    """``(width, height)`` of the image ``open_image`` would give, read from its header alone (nothing is decoded, and a
    file opened here is closed again): the EXIF orientation's quarter turns (5 to 8) swap the two. The same refusals
    as ``open_image`` short of decoding: what cannot be read, a path that is not a regular file, ``max_pixels``.

    A PNG whose EXIF sits after its pixels (PIL reads it only by decoding them) counts as upright here: its pixel count
    is the same either way, and the processor's own count is checked again after decoding."""
    where = where or f"image {index}"
    image, opened = _unread(value, media_dir, where)
    try:
        width, height = image.size
        if opened and _header_orientation(image) in (5, 6, 7, 8):
            width, height = height, width
    except Exception as exc:  # noqa: BLE001 - a header PIL cannot make sense of
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc})") from None
    finally:
        if opened:
            image.close()
    _check_pixels((width, height), max_pixels, where)
    return width, height


def _unread(value: Any, media_dir: str | None, where: str) -> tuple[Any, bool]:
    """``(PIL image with its header read and no pixel decoded, whether it was opened here)``; ``MediaError`` naming
    ``where`` when ``value`` holds no image that can be read."""
    from PIL import Image

    try:
        if isinstance(value, Image.Image):
            return value, False
        if isinstance(value, dict):  # a datasets Image struct: {"bytes", "path"}
            data, path = value.get("bytes"), value.get("path")
            if data is None and path is None:
                raise MediaError(f"{where}: the image struct holds neither bytes nor a path")
            return _unread(data if data is not None else path, media_dir, where)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return _open(io.BytesIO(bytes(value))), True
        if isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if text.startswith("data:"):
                return _open(io.BytesIO(base64.b64decode(text.split(",", 1)[1]))), True
            if "://" in text:
                raise MediaError(
                    f"{where} is a URL ({shortened(text)}); lossmask never fetches: put the image itself in the row "
                    "(a path, bytes or a PIL image, in the 'images' column or the part's 'image')")
            return _open(_regular_file(text, media_dir, where)), True
        if value is None:
            raise MediaError(f"{where}: an image part has no image (give the row's images in an 'images' column)")
        raise MediaError(f"{where}: cannot read an image from a {type(value).__name__}; pass a path, bytes or a PIL image")
    except MediaError:
        raise
    except Exception as exc:  # PIL's UnidentifiedImageError, a missing file, bad base64
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc})") from None


def _check_pixels(size: tuple[int, int], max_pixels: int | None, where: str) -> None:
    width, height = size
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(f"{where} is {width}x{height}, {width * height:,} pixels, over max_image_pixels="
                         f"{max_pixels:,}; shrink it, or raise max_image_pixels (--max-image-pixels)")


def _header_orientation(image: Any) -> int:
    """The EXIF orientation the header holds (1: upright). A PNG's ``getexif`` decodes the whole image when its eXIf
    chunk was not met before the pixels; such a PNG is taken as upright (``image_size``)."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return int(image.getexif().get(EXIF_ORIENTATION, 1) or 1)


EXIF_ORIENTATION = 0x0112


def _open(source: Any) -> Any:
    """``PIL.Image.open`` (the header only), without its size warning: ``max_pixels`` is the bound here."""
    import warnings

    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(source)


def _regular_file(path: str, media_dir: str | None, where: str) -> str:
    """``path``, read from ``media_dir`` when relative; ``MediaError`` unless it is a regular file (after links)."""
    import stat

    full = os.path.join(media_dir, path) if media_dir is not None and not os.path.isabs(path) else path
    try:
        mode = os.stat(full).st_mode
    except OSError as exc:
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc.strerror}: {full!r})") from None
    if not stat.S_ISREG(mode):
        raise MediaError(f"{where}: {full!r} is not a regular file (a folder, FIFO or device is never read)")
    return full


def probe_image():
    """A small image for the probes: big enough for every processor's smallest grid."""
    from PIL import Image

    return Image.new("RGB", (PROBE_SIZE, PROBE_SIZE), (128, 64, 32))


PROBE_SIZE = 56


# -- videos (Qwen2-VL, Qwen2.5-VL): a list of frames, counted as the video processor counts them --------------

# processors whose video expansion lossmask computes: each ``video_token`` becomes ``video_grid_thw.prod() //
# merge_size**2`` copies of itself, and the template writes nothing else per video (Qwen3-VL adds timestamp text)
VIDEO_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")
VIDEO_PART_KEYS = ("video", "path", "url")
# ``Qwen2VLVideoProcessor``'s own defaults (its class attributes, checked against it by the tests), for settings that
# its configuration leaves out
QWEN2_VL_VIDEO_DEFAULTS = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
                           "temporal_patch_size": 2, "merge_size": 2, "do_sample_frames": False,
                           "cap_pixels_per_frame": None, "max_video_tokens": 128000}
VIDEO_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "do_sample_frames", "cap_pixels_per_frame",
                  "max_video_tokens")
VIDEO_NO_PROCESSOR = ("video rows need transformers' video processor for their pixels, which needs torchvision "
                      "(pip install torchvision matching your torch)")


def is_video_part(part: Any) -> bool:
    """A part the template writes as a video: ``{"type": "video"}`` (or one holding a ``video``), not an image."""
    return isinstance(part, dict) and not is_image_part(part) and (part.get("type") == "video" or "video" in part)


def video_parts(messages: Sequence[Any]) -> list[Any]:
    """The video parts of a chat, in the order the template writes them."""
    return [part for part in content_parts(messages) if is_video_part(part)]


def row_videos(messages: Sequence[Any], given: Any) -> list[Any]:
    """A row's videos (each a list of frames, or a file): its ``videos`` column when it holds some, else what its
    video parts carry inline."""
    if given:
        return list(given)
    return [next((p[key] for key in VIDEO_PART_KEYS if p.get(key) is not None), None) for p in video_parts(messages)]


def unexpanded_media(messages: Sequence[Any], videos: bool) -> str | None:
    """The type of the first part lossmask does not expand (audio; a video unless ``videos``), or None."""
    for part in content_parts(messages):
        if isinstance(part, dict) and part.get("type") in OTHER_MEDIA and not (videos and is_video_part(part)):
            return part["type"]
    return None


@dataclass(frozen=True)
class VideoGrid:
    """The settings of a Qwen2-VL video processor that fix its token count: frames resized as ``smart_resize`` does
    (``min_pixels``/``max_pixels``: its ``size`` shortest/longest edge), padded to a multiple of
    ``temporal_patch_size`` with copies of the last, cut into ``patch_size`` patches merged ``merge_size`` square."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    do_sample_frames: bool = False
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000

    @classmethod
    def from_settings(cls, settings: dict, call: dict) -> "VideoGrid":
        """From a video processor's configuration (missing settings: ``Qwen2VLVideoProcessor``'s defaults) and the
        keywords of a processor call (``processor_kwargs``: flat, or in ``videos_kwargs``), each read as the video
        processor reads it: ``min_pixels``/``max_pixels`` override ``size``."""
        merged = {**QWEN2_VL_VIDEO_DEFAULTS}
        for given in (settings, call, call.get("videos_kwargs") or {}):
            size = dict(given.get("size") or merged["size"])
            for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                if given.get(key) is not None:
                    size[edge] = given[key]
            merged.update({k: given[k] for k in VIDEO_SETTINGS if given.get(k) is not None}, size=size)
        size = merged["size"]
        return cls(int(merged["patch_size"]), int(merged["temporal_patch_size"]), int(merged["merge_size"]),
                   int(size["shortest_edge"]), int(size["longest_edge"]), bool(merged["do_sample_frames"]),
                   bool(merged["cap_pixels_per_frame"]), int(merged["max_video_tokens"]))

    def tokens(self, frames: int, height: int, width: int) -> int:
        """The ``video_token`` copies a video of ``frames`` frames of ``height`` x ``width`` pixels makes."""
        try:  # transformers 5 keeps it beside the PIL image processor; 4.x in the only one
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        except ImportError:
            from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:  # an even share of the whole video's pixel budget, per frame
            budget = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, budget * self.temporal_patch_size // frames), int(self.min_pixels * 1.05))
        h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)
        grid_t = -(-frames // self.temporal_patch_size)
        return grid_t * (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2


def processor_video_settings(processor: Any) -> dict | str:
    """What the processor's video processor is built from (a dict), or why its videos cannot be counted (a line)."""
    name = type(processor).__name__
    if name not in VIDEO_PROCESSORS:
        return f"lossmask expands images only for a {name} (video parts: {' and '.join(VIDEO_PROCESSORS)} only)"
    video = getattr(processor, "video_processor", None)
    if video is not None:  # a real one (torchvision installed): its own settings
        size = video.size
        edges = {e: getattr(size, e, None) if not isinstance(size, dict) else size.get(e)
                 for e in ("shortest_edge", "longest_edge")}
        return {**{k: getattr(video, k, None) for k in VIDEO_SETTINGS}, "size": edges}
    settings = getattr(processor, "video_settings", None)
    if settings is None:
        return (f"the {name} has no video processor, and was not loaded from a folder by lossmask (whose configuration "
                "would give its settings); pass the processor's folder")
    return settings


def video_token_counts(grid: VideoGrid, videos: Sequence[Any], options: Any,
                       budget: int | None = None) -> tuple[list[int], bool]:
    """Per video (a list of frames), the ``video_token`` copies the processor makes; ``MediaError`` naming the video
    (or its frame) when it cannot be used. Only each frame's header is read (``image_size``: EXIF applied, regular
    files only, ``max_image_pixels``): the count needs their sizes, which must all be one, as the processor stacks
    them; their pixels are the trainer's video processor's to decode.

    ``budget``: reading stops as soon as the videos' tokens pass it. Returns ``(counts, complete)``: where reading
    stopped, the counts end with the stopped video's frames so far (at least that many tokens), ``complete`` False."""
    out: list[int] = []
    for v, frames in enumerate(videos):
        where = f"video {v}"
        if frames is None:
            raise MediaError(f"{where}: a video part has no video (give its frames as a list of images, in the part's "
                             "'video' or a 'videos' column)")
        if isinstance(frames, (str, os.PathLike, bytes, dict)):
            shown = quoted(os.fspath(frames)) if isinstance(frames, (str, os.PathLike)) else type(frames).__name__
            raise MediaError(f"{where} is a file ({shown}); lossmask decodes no video file: pass the video as a list "
                             "of its frames (paths, bytes or images), the frames the processor is to see")
        if not isinstance(frames, (list, tuple)) or not frames:
            raise MediaError(f"{where}: a video is a non-empty list of frames (paths, bytes or images), got "
                             f"{type(frames).__name__ if frames is not None else None}")
        if grid.do_sample_frames:
            raise MediaError(f"{where}: the video processor samples frames (do_sample_frames), which lossmask does not "
                             "reproduce; pass the frames to train on with do_sample_frames=False")
        size = None
        left = None if budget is None else budget - sum(out)
        for f, frame in enumerate(frames):
            found = image_size(frame, index=f, media_dir=options.media_dir, max_pixels=options.max_image_pixels,
                               where=f"{where} frame {f}")
            if size is not None and found != size:
                raise MediaError(f"{where}: its frames are not all one size ({sorted({size, found})}); the processor "
                                 "stacks them into one array")
            size = found
            # the video makes at least as many tokens as its frames so far (not so where each frame's share of a
            # whole-video cap shrinks as frames are added: that one is checked at the end)
            if left is not None and not grid.cap_pixels_per_frame:
                so_far = _video_tokens(grid, f + 1, size, where)
                if so_far > left:
                    return out + [so_far], False
        out.append(_video_tokens(grid, len(frames), size, where))
    return out, True


def _video_tokens(grid: VideoGrid, frames: int, size: tuple[int, int], where: str) -> int:
    width, height = size
    try:
        return grid.tokens(frames, height, width)
    except ValueError as exc:  # smart_resize: an aspect ratio over 200
        raise MediaError(f"{where}: the processor cannot take its {width}x{height} frames ({exc})") from None


# -- what the template and the processor write for an image ------------------------------------------

@dataclass(frozen=True)
class MediaTokens:
    """What one processor writes for images, derived and checked by ``media_tokens``.

    ``placeholder``: the string the processor expands (``processor.image_token``); ``part_text``: what the
    template writes for one image part; ``ids``: every media token id (never trained); ``counted``: the
    ids whose number in a row is the number of image tokens the processor produced for its images."""

    placeholder: str
    part_text: str
    ids: tuple[int, ...]
    counted: tuple[int, ...]
    counted_text: tuple[str, ...]
    # videos (``VIDEO_PROCESSORS``): the processor's ``video_token``, what the template writes for one video part, and
    # the video processor's settings; where videos are not expanded, ``video_settings`` says why (a line)
    video_placeholder: str | None = None
    video_part_text: str | None = None
    video_settings: dict | str = "lossmask expands images only here"
    # the counted tokens the probe image made: the least an image is reckoned at where the processor cannot count
    probe_count: int = 0

    def expected(self, replacements: Sequence[str]) -> int:
        """How many counted tokens the processor's replacement strings for one row's images hold."""
        return sum(r.count(t) for r in replacements for t in self.counted_text)

    def per_image(self, tok: Any, replacement: str) -> tuple[int, int, int]:
        """What one image writes into a row: its media tokens (its part, with the placeholder expanded; they are
        special tokens, so their number does not depend on the text around them), and how many tokens of plain text
        the part holds before its first media token and after its last: the processor's edge text (Gemma-3's blank
        lines; with pan-and-scan, "Here is the original image" before it) and the template's own (LLaVA's newline
        after ``<image>``). Every one of them is the image's."""
        return self.per_part(tok, self.part_text, self.placeholder, replacement)

    def per_video(self, tok: Any, replacement: str) -> tuple[int, int, int]:
        """``per_image`` for one video part."""
        return self.per_part(tok, self.video_part_text, self.video_placeholder, replacement)

    def per_part(self, tok: Any, part_text: str, placeholder: str, replacement: str) -> tuple[int, int, int]:
        cache = self.__dict__.setdefault("_per_image", {})
        key = (part_text, replacement)
        if key not in cache:
            ids = set(self.ids)
            part = [int(t) in ids for t in tok.encode(part_text.replace(placeholder, replacement))]
            first = part.index(True) if any(part) else 0
            last = len(part) - 1 - part[::-1].index(True) if any(part) else len(part) - 1
            cache[key] = (sum(part), first, len(part) - 1 - last)
        return cache[key]

    def blank(self, tok: Any, token: int) -> bool:
        """Is ``token`` spaces alone: the separator a template writes before an image part, left by itself where the
        image's special token stops the tokeniser merging it into a word (LLaVA's ``ASSISTANT: <image>``)? A newline
        is not: it may be a header's (Qwen2-VL's ``user\n``)."""
        cache = self.__dict__.setdefault("_blank", {})
        if token not in cache:
            cache[token] = tok.decode([int(token)]).strip(" ") == "" and int(token) not in tok.special_ids
        return cache[token]


def media_tokens(tok: Any) -> MediaTokens:
    """The media tokens of a ``ChatTokenizer`` built over a processor (cached on it); ``MediaDetectionError`` when
    the template's image handling cannot be verified."""
    cached = getattr(tok, "_media_tokens", None)
    if cached is not None:
        return cached
    processor = getattr(tok, "processor", None)
    if processor is None:
        raise MediaDetectionError(f"{tok.name!r} is a tokenizer, not a processor; pass the model's processor (or its "
                                  "folder, holding preprocessor_config.json) to label chats with images")
    media = _derive(tok, processor)
    tok._media_tokens = media
    return media


def _derive(tok: Any, processor: Any) -> MediaTokens:
    name = tok.name
    placeholder = getattr(processor, "image_token", None)
    vocab = tok.tokenizer.get_vocab()
    if not placeholder or placeholder not in vocab or vocab[placeholder] not in tok.added_ids:
        raise MediaDetectionError(f"the processor of {name!r} has no image token that is one added token of its "
                                  f"vocabulary (image_token={placeholder!r}); lossmask cannot tell its images apart")
    a, b = PROBE_TEXT
    image = {"type": "image"}

    def chat(*parts):
        return [{"role": "user", "content": [*parts, {"type": "text", "text": a}]},
                {"role": "assistant", "content": [{"type": "text", "text": b}]}]

    try:
        renders = [tok.render(chat(*[image] * n)) for n in (0, 1, 2, 3)]
    except Exception as exc:  # noqa: BLE001 - any failure means the handling cannot be verified
        raise MediaDetectionError(f"the chat template of {name!r} cannot render an image part ({exc})") from exc
    # the part one more image adds, read between chats that already hold images: a template may write other text
    # once a chat holds any image (Mllama's drops its system block, the date in it, from a chat with images)
    part = _inserted(renders[1], renders[2])
    if part is None or part.count(placeholder) != 1 or _inserted(renders[2], renders[3]) != part:
        raise MediaDetectionError(
            f"the chat template of {name!r} does not write the processor's image token {placeholder!r} once per "
            f"image part (it wrote {part!r} for one image); pass the processor whose template writes it, or "
            "chat_template= with one that does")
    from ..options import DEFAULT_MAX_MEDIA_TOKENS

    probe = sum(processor_count(processor, [(PROBE_SIZE, PROBE_SIZE)], {}) or [0])
    if probe > DEFAULT_MAX_MEDIA_TOKENS:  # a config (min_pixels) that blows every image up
        raise MediaDetectionError(
            f"the processor of {name!r} would make {probe:,} image tokens for a {PROBE_SIZE}x{PROBE_SIZE} probe image, "
            f"over {DEFAULT_MAX_MEDIA_TOKENS:,}; check its image-processor config (min_pixels, size)")
    try:
        _, replacements = processor_images(processor, [probe_image()])
    except Exception as exc:  # noqa: BLE001
        raise MediaDetectionError(f"the processor of {name!r} could not expand a probe image ({exc})") from exc
    expanded = part.replace(placeholder, replacements[0])
    # media ids: the special tokens an image writes, and that a chat without images never holds (a plain-text
    # token of the expansion, such as Gemma-3's blank lines, is text: the marker rule labels it)
    special = tok.special_ids
    plain = {int(i) for i in tok.encode(renders[0])}
    ids = ({int(i) for i in tok.encode(expanded) if int(i) in special} | {vocab[placeholder]}) - plain
    counted = [int(i) for i in (getattr(processor, "image_token_ids", None) or []) if i is not None]
    counted = [i for i in counted if i in ids] or [vocab[placeholder]]
    counted_text = tuple(tok.tokenizer.convert_ids_to_tokens(counted))
    probe_count = sum(replacements[0].count(t) for t in counted_text)
    # the processor's own tokenisation of a probe row must be lossmask's, media tokens and all
    text = renders[1]
    mine = tok.encode(text.replace(placeholder, replacements[0]))
    theirs = processor(text=[text], images=[[probe_image()]], add_special_tokens=False)["input_ids"][0]
    if list(map(int, theirs)) != list(map(int, mine)):
        raise MediaDetectionError(f"the processor of {name!r} tokenises an expanded image row differently from its "
                                  "tokenizer; lossmask cannot label its rows")
    video = _derive_video(tok, processor, chat, renders[0], plain)
    if video[0] is not None:  # the video token joins the media ids and the counted ones
        ids |= video[2]
        counted.append(vocab[video[0]])
        counted_text += (video[0],)
    return MediaTokens(placeholder, part, tuple(sorted(ids)), tuple(counted), counted_text, video[0], video[1],
                       video[3], probe_count)


def _derive_video(tok: Any, processor: Any, chat: Any, plain_render: str, plain: set) -> tuple:
    """``(video token, the template's video part, its media ids, settings)`` for a processor whose videos lossmask
    expands; ``(None, None, set(), why not)`` for any other."""
    settings = processor_video_settings(processor)
    placeholder = getattr(processor, "video_token", None)
    vocab = tok.tokenizer.get_vocab()
    if isinstance(settings, str):
        return None, None, set(), settings
    if not placeholder or placeholder not in vocab or vocab[placeholder] not in tok.added_ids:
        return None, None, set(), (f"the processor's video token {placeholder!r} is not one added token of its "
                                   "vocabulary")
    video = {"type": "video"}
    try:
        renders = [plain_render] + [tok.render(chat(*[video] * n)) for n in (1, 2)]
    except Exception as exc:  # noqa: BLE001
        return None, None, set(), f"its chat template cannot render a video part ({exc})"
    part = _inserted(renders[0], renders[1])
    if part is None or part.count(placeholder) != 1 or _inserted(renders[1], renders[2]) != part:
        return None, None, set(), (f"its chat template does not write the video token {placeholder!r} once per video "
                                   f"part (it wrote {part!r})")
    special = tok.special_ids
    ids = ({int(i) for i in tok.encode(part) if int(i) in special} | {vocab[placeholder]}) - plain
    return placeholder, part, ids, settings


def _inserted(shorter: str, longer: str) -> str | None:
    """What ``longer`` adds to ``shorter`` at one place (None when it is not one insertion)."""
    if len(longer) <= len(shorter):
        return None
    start = 0
    while start < len(shorter) and shorter[start] == longer[start]:
        start += 1
    end = 0
    while end < len(shorter) - start and shorter[-1 - end] == longer[-1 - end]:
        end += 1
    inserted = longer[start:len(longer) - end]
    return inserted if shorter[:start] + inserted + shorter[len(shorter) - end:] == longer else None


def processor_images(processor: Any, images: list, **kwargs: Any) -> tuple[dict, list[str]]:
    """The processor's own image step: ``(features, replacement string per image)``, images flat, in order;
    ``kwargs`` as a call of the processor takes them (``do_pan_and_scan=True``)."""
    merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs, **kwargs)
    return processor._process_images(images, **merged["images_kwargs"])


# -- rows --------------------------------------------------------------------------------------------

@dataclass
class ExpandedRows:
    """Rendered rows with each image placeholder replaced by the processor's expansion.

    ``texts``: per row, expanded (rows without images unchanged); ``refused``: ``(index, message)`` of rows
    whose images cannot be used; ``expected``: per row, the number of counted media tokens its images make;
    ``features``: the processor's image outputs for the kept rows' images, in row order (``pixel_values``...)."""

    texts: list[str]
    refused: list[tuple[int, str]]
    expected: np.ndarray
    features: dict
    images: int
    # per row, ``MediaTokens.per_image`` of each of its images (in order): each image's span of tokens, from its first
    # media token to its last (Idefics3's tile tags are plain text inside it), and the token next to it where the
    # expansion has plain text at that edge (Gemma-3's blank lines), is never trained
    per_image: list[list[tuple[int, int, int]]] = field(default_factory=list)
    videos: int = 0  # videos expanded (their parts are in ``per_image`` too, in row order)


def expand_rows(tok: Any, texts: Sequence[str], chats: Sequence[Any], given: Sequence[Any] | None,
                options: Any = None, *, keep_features: bool = False,
                given_videos: Sequence[Any] | None = None) -> ExpandedRows:
    """Check each row's images, their number against the placeholders, and expand the placeholders.

    ``given``: per row, its images (the ``images`` column, or None); ``given_videos``: per row, its videos (the
    ``videos`` column, or None). ``options`` (a ``MaskOptions``): where relative paths are read (``media_dir``), the
    keywords of every processor call (``processor_kwargs``) and the bounds (``max_image_pixels``, ``max_media_tokens``).

    Two passes, so that what a row costs is known before it costs it. First every row is checked from its images'
    headers alone: their number, ``max_image_pixels``, and the tokens its images (``estimated_tokens``) and videos
    (``video_token_counts``, stopped as soon as the row passes the bound) make against ``max_media_tokens``; nothing
    is decoded. Then the rows that passed are decoded and go through the processor one bounded group of images at a
    time (``_image_groups``), each group let go before the next, and only the replacement strings are kept: memory
    holds one group, whatever the batch size or the number of images in a row. With ``keep_features`` (a collator)
    all images of the batch go through the processor in one call and its outputs are kept. A row that fails a check,
    whose image cannot be decoded or that the processor rejects, is refused, named.

    Videos (Qwen2-VL, Qwen2.5-VL: ``MediaTokens.video_placeholder``), each a list of frames, are counted from their
    frames' sizes as the video processor counts them (``VideoGrid``); their tokens join the row's media tokens."""
    from ..options import MaskOptions

    options = options if options is not None else MaskOptions()
    kwargs = options.processor_call_kwargs()
    media = media_tokens(tok)
    grid = (VideoGrid.from_settings(media.video_settings, kwargs) if media.video_placeholder is not None else None)
    out = list(texts)
    refused: list[tuple[int, str]] = []
    expected = np.zeros(len(texts), dtype=np.int64)
    per_image: list[list[tuple[int, int, int]]] = [[] for _ in texts]
    rows: list[_Checked] = []  # the rows that passed, their images not yet decoded
    for k, (text, chat) in enumerate(zip(texts, chats)):
        messages = chat["messages"] if isinstance(chat, dict) else chat
        typed = typed_placeholder(tok, media, messages)
        if typed:
            refused.append((k, typed))
            continue
        unsupported = unexpanded_media(messages, grid is not None)
        if unsupported:
            why = media.video_settings if unsupported == "video" and isinstance(media.video_settings, str) else \
                "lossmask expands images and {'type': 'video'} parts only" if grid else "lossmask expands images only"
            refused.append((k, f"a {unsupported!r} part: {why}; drop the part or the row"))
            continue
        values = row_images(messages, given[k] if given is not None else None)
        slots = text.count(media.placeholder)
        video_values = row_videos(messages, given_videos[k] if given_videos is not None else None) if grid else []
        video_slots = text.count(media.video_placeholder) if grid else 0
        if not values and not slots and not video_values and not video_slots:
            continue
        if len(values) != slots:
            refused.append((k, f"{len(values)} image(s) given for {slots} image placeholder(s) "
                               f"{media.placeholder!r} in the rendered chat; give one image per image part"))
            continue
        if len(video_values) != video_slots:
            refused.append((k, f"{len(video_values)} video(s) given for {video_slots} video placeholder(s) "
                               f"{media.video_placeholder!r} in the rendered chat; give one video per video part"))
            continue
        checked = _check_row(tok, media, grid, k, values, video_values, options, kwargs)
        if isinstance(checked, str):
            refused.append((k, checked))
            continue
        rows.append(checked)
    replacements, failed, features = _run_images(tok.processor, rows, options, kwargs, keep_features,
                                                 n_rows=len(texts))
    refused += sorted(failed.items())
    slot = re.compile("|".join(re.escape(p) for p in (media.placeholder, media.video_placeholder) if p))
    for row in rows:
        k = row.row
        if k in failed:
            continue
        row_replacements = replacements.get(k, [])
        row_videos_ = [media.video_placeholder * n for n in row.videos]
        made = media.expected(row_replacements + row_videos_)
        if made > options.max_media_tokens:
            refused.append((k, _over_bound(made, options.max_media_tokens, _what(row_videos_))))
            continue
        images_left, videos_left = iter(row_replacements), iter(row_videos_)
        pieces, parts, last = [], [], 0
        for match in slot.finditer(out[k]):  # each placeholder, in the order the template wrote them
            is_video = match.group() == media.video_placeholder
            replacement = next(videos_left if is_video else images_left)
            pieces += [out[k][last:match.start()], replacement]
            parts.append(media.per_video(tok, replacement) if is_video else media.per_image(tok, replacement))
            last = match.end()
        out[k] = "".join(pieces) + out[k][last:]
        expected[k] = made
        per_image[k] = parts
    refused.sort()
    return ExpandedRows(out, refused, expected, features, sum(len(r.values) for r in rows),
                        per_image, sum(len(r.videos) for r in rows))


# the placeholders LLaMA-Factory's rows type in their text, one per entry of the row's images / videos / audios
TEXT_PLACEHOLDERS = ("<image>", "<video>", "<audio>")


def typed_placeholder(tok: Any, media: MediaTokens, messages: Sequence[Any]) -> str | None:
    """Why a chat is refused through a processor when a message's text (``locate.message_pieces``: its string content,
    text parts, reasoning) types a media placeholder, or None: ``<image>``, ``<video>``, ``<audio>`` (LLaMA-Factory's),
    the processor's own placeholders and the text of every media token (``<|image_pad|>``, ``<start_of_image>``,
    ``<|image|>``). One rule for every processor: an image is a content part, never text, whether or not the
    processor's placeholder is ``<image>`` (LLaVA's and Idefics3's are; Qwen2-VL's, Gemma-3's and Mllama's are not)."""
    pattern = media.__dict__.get("_typed")
    if pattern is None:
        strings = {*TEXT_PLACEHOLDERS, media.placeholder, *(p for p in (media.video_placeholder,) if p),
                   *tok.tokenizer.convert_ids_to_tokens(list(media.ids))}
        pattern = re.compile("|".join(re.escape(t) for t in sorted(strings, key=len, reverse=True)))
        media.__dict__["_typed"] = pattern
    for index, message in enumerate(messages or ()):
        for value, _, _ in message_pieces(message):  # its content's text, its reasoning's
            found = pattern.search(value)
            if found:
                return (f"message {index} ({message.get('role')}) types the media placeholder {found.group()!r} in its "
                        "text; through a processor an image or video is a content part ({'type': 'image'}), never "
                        "text: put a part where each one goes (LLaMA-Factory rows: split the text at each "
                        "placeholder), or take the string out of the message")
    return None


@dataclass
class _Checked:
    """A row whose images and videos passed the checks made from their headers: its images as the row holds them
    (decoded later, a group at a time), each one's ``(height, width)`` and estimated tokens, and each video's count."""

    row: int
    values: list
    sizes: list[tuple[int, int]]
    tokens: list[int]
    videos: list[int]


def _check_row(tok: Any, media: MediaTokens, grid: VideoGrid | None, k: int, values: list, video_values: list,
               options: Any, kwargs: dict) -> _Checked | str:
    """A row checked from its images' and frames' headers alone: a ``_Checked``, or why it is refused (a line). Its
    images' estimated tokens are checked before its videos are read, and the videos stop as soon as the row's
    running total passes ``max_media_tokens``."""
    bound = options.max_media_tokens
    try:
        sizes = [image_size(v, index=i, media_dir=options.media_dir, max_pixels=options.max_image_pixels)[::-1]
                 for i, v in enumerate(values)]
        tokens, exact = estimated_tokens(tok.processor, sizes, kwargs, floor=media.probe_count)
        if sum(tokens) > bound:
            return _over_bound(sum(tokens), bound, _what(video_values), "" if exact else UNCOUNTED)
        counts, complete = (video_token_counts(grid, video_values, options, bound - sum(tokens)) if video_values
                            else ([], True))
    except MediaError as exc:
        return str(exc)
    total = sum(tokens) + sum(counts)
    if total > bound:
        note = "" if complete else f" (at least: video {len(counts) - 1}'s frames were read no further)"
        return _over_bound(total, bound, _what(video_values), note)
    return _Checked(k, values, sizes, tokens, counts)


def _run_images(processor: Any, rows: Sequence[_Checked], options: Any, kwargs: dict,
                keep_features: bool, n_rows: int = 0) -> tuple[dict[int, list[str]], dict[int, str], dict]:
    """The processor's replacement string for each image of ``rows``: ``({row: its strings, in order}, {row: why it is
    refused}, the processor's outputs)``. Images are decoded (``open_image``) a group at a time, just before the
    group's processor call, and let go after it. Where a group fails, its images go again one at a time, so that only
    the rows of the images the processor rejects are refused. With ``keep_features``, one group holds every image and
    the processor's outputs are kept (else they are ``{}``): the images go in one list per row of the ``n_rows`` (empty
    for a row without any), as ``processor(text=rows, images=[[...], ...])`` lays them out, so that the fields laid out
    per row (Idefics3's and Mllama's ``pixel_values``, Mllama's ``num_tiles``) are the processor's own."""
    done: dict[int, list] = {row.row: [None] * len(row.values) for row in rows}
    kept: dict = {}
    failed: dict[int, str] = {}
    groups = [[(row, i) for row in rows for i in range(len(row.values))]] if keep_features else _image_groups(rows)
    for group in groups:
        decoded = []
        for row, i in group:
            if row.row in failed:
                continue
            try:
                decoded.append((row.row, i, open_image(row.values[i], index=i, media_dir=options.media_dir,
                                                       max_pixels=options.max_image_pixels)))
            except MediaError as exc:
                failed[row.row] = str(exc)
        decoded = [item for item in decoded if item[0] not in failed]
        if not decoded:
            continue
        images: list = [image for _, _, image in decoded]
        if keep_features:  # one list per row, as the processor's own call lays a batch out
            images = [[] for _ in range(n_rows)]
            for k, _, image in decoded:
                images[k].append(image)
        try:
            features, replacements = processor_images(processor, images, **kwargs)
        except Exception:  # noqa: BLE001 - some image the processor rejects: find it, one image at a time
            for k, i, image in decoded:
                if k in failed:
                    continue
                try:
                    done[k][i] = processor_images(processor, [image], **kwargs)[1][0]
                except Exception as exc:  # noqa: BLE001
                    failed[k] = f"the processor cannot take its images ({type(exc).__name__}: {exc})"
            if keep_features and not failed:  # each image alone passes: the batch's call is what fails
                processor_images(processor, images, **kwargs)
            continue
        if keep_features:
            kept = dict(features)
        for (k, i, _), replacement in zip(decoded, replacements):
            done[k][i] = replacement
        del decoded, features  # the group's pixels go before the next group's are made
    return {k: v for k, v in done.items() if k not in failed}, failed, kept


# the most one group of images holds when the processor's outputs are not kept: decoded pixels (about 50 MB as RGB),
# estimated image tokens (the processor's pixel values and its working copies grow with them: some 50 KB per Qwen2-VL
# token) and images (a single image over a bound goes alone)
IMAGE_GROUP_PIXELS = 1 << 24
IMAGE_GROUP_TOKENS = 8192
IMAGE_GROUP_IMAGES = 256


def _image_groups(rows: Sequence[_Checked]) -> Iterator[list[tuple[_Checked, int]]]:
    """The images of ``rows`` in order, ``(row, index)``, in groups within the ``IMAGE_GROUP_*`` bounds; a row's
    images may fall into several groups (each image's replacement depends on that image alone)."""
    group: list[tuple[_Checked, int]] = []
    pixels = tokens = 0
    for row in rows:
        for i, ((height, width), n) in enumerate(zip(row.sizes, row.tokens)):
            if group and (pixels + height * width > IMAGE_GROUP_PIXELS or tokens + n > IMAGE_GROUP_TOKENS
                          or len(group) >= IMAGE_GROUP_IMAGES):
                yield group
                group, pixels, tokens = [], 0, 0
            group.append((row, i))
            pixels, tokens = pixels + height * width, tokens + n
    if group:
        yield group


# where the processor cannot count its tokens from the sizes, each image is reckoned at one token per 14x14 pixels (the
# smallest patch of these models, before any merging), or what the probe image made when that is more
UNCOUNTED_PIXELS_PER_TOKEN = 14 * 14
UNCOUNTED = (" (an upper bound: the processor gives no count from the sizes, so each image is reckoned at one token "
             "per 14x14 pixels)")


def estimated_tokens(processor: Any, sizes: Sequence[tuple[int, int]], kwargs: dict,
                     floor: int = 0) -> tuple[list[int], bool]:
    """Per image (``(height, width)``, EXIF applied), the image tokens the processor makes for it, reckoned from its
    size alone, before any pixel is decoded; and whether that is the processor's own count.

    The processor's count (``_get_num_multimodal_tokens``), times one plus the image's pan-and-scan crops where the
    call makes them (``pan_and_scan_crops``: transformers' count leaves them out). Where the processor has no count,
    or its count fails, an upper bound from the pixels (``UNCOUNTED_PIXELS_PER_TOKEN``, at least ``floor``), so that no
    image escapes the bound; the count made after the image step is checked against the bound again either way."""
    if not sizes:
        return [], True
    counted = processor_count(processor, sizes, kwargs)
    exact = counted is not None
    if counted is None:
        counted = [max(floor, -(-height * width // UNCOUNTED_PIXELS_PER_TOKEN)) for height, width in sizes]
    crops = pan_and_scan_crops(processor, sizes, kwargs)
    return [n * (1 + c) for n, c in zip(counted, crops)], exact


def processor_count(processor: Any, sizes: Sequence[tuple[int, int]], kwargs: dict) -> list[int] | None:
    """The processor's own count of image tokens per image (``(height, width)``), from ``_get_num_multimodal_tokens``;
    None where it has none, or it fails."""
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is None:
        return None
    try:
        data = count(image_sizes=[tuple(size) for size in sizes], **kwargs)
        found = [int(n) for n in (getattr(data, "num_image_tokens", None) or data["num_image_tokens"])]
    except Exception:  # noqa: BLE001 - a processor whose count needs what it was not given
        return None
    return found if len(found) == len(sizes) else None


def pan_and_scan_crops(processor: Any, sizes: Sequence[tuple[int, int]], kwargs: dict) -> list[int]:
    """Per image (``(height, width)``), the crops Gemma-3's pan-and-scan adds to it in a call with ``kwargs`` (0 each
    where the image processor has no pan-and-scan, or the call does not ask for it). Each crop is one more image of the
    processor's fixed size, so its tokens are the image's again."""
    image_processor = getattr(processor, "image_processor", None)
    if not hasattr(image_processor, "pan_and_scan"):
        return [0] * len(sizes)
    settings = _image_settings(processor, kwargs)
    if not settings.get("do_pan_and_scan"):
        return [0] * len(sizes)
    return [_crops(height, width, settings["pan_and_scan_min_crop_size"], settings["pan_and_scan_max_num_crops"],
                   settings["pan_and_scan_min_ratio_to_activate"]) for height, width in sizes]


def _crops(height: int, width: int, min_crop: float, max_crops: int, min_ratio: float) -> int:
    """Gemma-3's pan-and-scan arithmetic: an image whose long side is at least ``min_ratio`` times its short side is
    cut along its long side into about that ratio of near-square crops (rounded half up), at most one per ``min_crop``
    pixels of the long side, then held to between 2 and ``max_crops``; none when a crop would be under ``min_crop``
    on either side."""
    long, short = max(height, width), min(height, width)
    if short <= 0 or long / short < min_ratio:
        return 0
    n = min(math.floor(long / short + 0.5), math.floor(long / min_crop))
    n = min(max(2, n), max_crops)
    return 0 if min(math.ceil(long / n), short) < min_crop else int(n)


def _image_settings(processor: Any, kwargs: dict) -> dict:
    """The image processor's settings in a processor call with ``kwargs``: the call's keywords over the processor's
    defaults over the image processor's own configuration, as the call resolves them."""
    merged = processor._merge_kwargs(tokenizer_init_kwargs=processor.tokenizer.init_kwargs, **kwargs)["images_kwargs"]
    image_processor = processor.image_processor
    standardize = getattr(image_processor, "_merge_and_standardize_kwargs", None)
    if standardize is not None:
        return dict(standardize(**merged))
    return {name: merged[name] if merged.get(name) is not None else getattr(image_processor, name, None)
            for name in {*merged, *PAN_AND_SCAN}}


PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                "pan_and_scan_min_ratio_to_activate")


def _what(videos: Sequence[Any]) -> str:
    return "images and videos" if videos else "images"


def _over_bound(tokens: int, bound: int, what: str = "images", note: str = "") -> str:
    return (f"its {what} make {tokens:,} {'image' if what == 'images' else 'media'} tokens, over max_media_tokens="
            f"{bound:,}{note}; shrink the {what}, or raise max_media_tokens (--max-media-tokens)")


def media_spans(ids: np.ndarray, offsets: np.ndarray, media_ids: Sequence[int],
                per_image: Sequence[Sequence[tuple[int, int, int]]], blank: Any = None) -> np.ndarray:
    """A bool per token (``ids`` flat, ``offsets`` per row): True over each image's tokens, from its first media token
    to its last, and over the plain-text tokens its part holds at each edge. Media tokens are special, so the
    tokeniser splits at them: the edge text keeps its own tokens (merged, at most, with a neighbour's whitespace:
    Gemma-3's ``model\n`` + blank line is ``model`` + ``\n\n\n``). ``blank(id)``: whether a token is spaces alone
    (``MediaTokens.blank``); such a token just outside an image (the space a template writes before the part) is the
    image's too.

    ``per_image``: per row, ``(media tokens, plain tokens before, plain tokens after)`` of each of its images, in
    order (``ExpandedRows.per_image``). A row whose media tokens are not that many (never after the count check)
    raises."""
    span = np.zeros(ids.shape[0] + 1, dtype=np.int32)
    at = np.flatnonzero(np.isin(ids, np.asarray(media_ids, dtype=ids.dtype)))
    row_of = np.searchsorted(offsets, at, side="right") - 1
    for r, images in enumerate(per_image):
        if not images:
            continue
        counts, lead, trail = (np.asarray(column) for column in zip(*images))
        mine = at[row_of == r]
        ends = np.cumsum(counts)
        if mine.shape[0] != ends[-1]:
            raise ValueError(f"row {r}: {mine.shape[0]} media tokens in its ids, its images write {int(ends[-1])}")
        starts = np.maximum(mine[ends - counts] - lead, offsets[r])
        stops = np.minimum(mine[ends - 1] + 1 + trail, offsets[r + 1])
        if blank is not None:  # one image at a time: a handful per row
            for k in range(starts.shape[0]):
                if starts[k] > offsets[r] and blank(ids[starts[k] - 1]):
                    starts[k] -= 1
                if stops[k] < offsets[r + 1] and blank(ids[stops[k]]):
                    stops[k] += 1
        np.add.at(span, starts, 1)
        np.add.at(span, stops, -1)
    return np.cumsum(span[:-1]) > 0


OTHER_MEDIA = ("video", "video_url", "audio", "input_audio")
# the columns that give a row's media (TRL and LLaMA-Factory lay rows out so: one entry per placeholder, in order)
MEDIA_COLUMNS = ("images", "videos", "audios")
# what the text of a tokenizer's media tokens says (Qwen2.5's <|image_pad|> and <|vision_start|>, Gemma-3's
# <start_of_image>, GLM-4's <|begin_of_image|>, Mistral's [IMG], Idefics3's <global-img>)
MEDIA_WORDS = re.compile(r"image|vision|video|audio|img", re.IGNORECASE)


def media_token_ids(tok: Any) -> dict[int, str]:
    """``{id: text}`` of the tokens that stand for media in a ``ChatTokenizer``'s vocabulary, for a text model too: the
    added tokens flagged special whose text names a medium (``MEDIA_WORDS``; Gemma's HTML ``<img>`` is not flagged
    special, and stays text), the tokens its ``image_token`` / ``video_token`` / ``audio_token`` name, and, through a
    processor, every media token ``media_tokens`` derives. A row holding one of them carries media in its ids."""
    cached = getattr(tok, "_media_token_ids", None)
    if cached is not None:
        return cached
    hf = tok.tokenizer
    found = {int(i): str(t.content) for i, t in hf.added_tokens_decoder.items()
             if getattr(t, "special", False) and MEDIA_WORDS.search(str(t.content))}
    vocab = None
    for owner in (hf, getattr(tok, "processor", None)):
        for name in ("image_token", "video_token", "audio_token"):
            text = getattr(owner, name, None) if owner is not None else None
            if isinstance(text, str) and text:
                vocab = vocab if vocab is not None else hf.get_vocab()
                if text in vocab:
                    found[int(vocab[text])] = text
    if getattr(tok, "processor", None) is not None:
        try:
            media = media_tokens(tok)
        except MediaDetectionError:
            pass
        else:
            found.update({int(i): hf.convert_ids_to_tokens(int(i)) for i in media.ids})
    tok._media_token_ids = found
    return found


def other_media(messages: Sequence[Any]) -> str | None:
    """The type of the first video or audio part of a chat (None when it has none)."""
    return unexpanded_media(messages, videos=False)


def count_media(ids: np.ndarray, offsets: np.ndarray, counted: Sequence[int]) -> np.ndarray:
    """Per row, how many of its tokens are counted media tokens (``ids`` flat, ``offsets`` of len rows + 1)."""
    hit = np.isin(ids, np.asarray(counted, dtype=ids.dtype)).astype(np.int64)
    sums = np.concatenate([[0], np.cumsum(hit)])
    return sums[offsets[1:]] - sums[offsets[:-1]]

