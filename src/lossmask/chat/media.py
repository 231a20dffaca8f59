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
fetched.

Which tokens train is the marker rule's business (``markers``); the media ids found here are never
trained (``markers.media.with_media``: each is a one-token ``mask_out`` pattern).
"""

from __future__ import annotations

import base64
import io
import json
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

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


def image_parts(messages: Sequence[Any]) -> list[Any]:
    """The image parts of a chat, in the order the template writes them."""
    out = []
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            out.extend(part for part in content if is_image_part(part))
    return out


def row_images(messages: Sequence[Any], given: Any) -> list[Any]:
    """A row's images: its ``images`` column when it holds some, else the images its parts carry inline."""
    if given is not None and not isinstance(given, (list, tuple)):
        given = [given]
    if given:
        return list(given)
    return [part_image(part) for part in image_parts(messages)]


def open_image(value: Any, *, index: int, media_dir: str | None = None, max_pixels: int | None = None) -> Any:
    """A PIL image from what a row holds, as the processor is to see it; ``MediaError`` naming the image when it cannot
    be used.

    An image opened here (a path, bytes, a ``{"bytes", "path"}`` struct, a ``data:`` URL) is turned as its EXIF
    orientation says, as transformers' ``load_image`` and the ``datasets`` Image feature do; a PIL image given is
    taken as it is. Its mode is kept (alpha, palette, CMYK...): the processor's own conversion (alpha composited onto
    white) makes the pixels. A relative path is read from ``media_dir`` (None: the current folder), and only a
    regular file is read (a FIFO or a device would block). An image of more than ``max_pixels`` pixels is refused
    from its header, before it is decoded."""
    from PIL import Image

    where = f"image {index}"  # the row is named by whoever reports it
    opened = True
    try:
        if isinstance(value, Image.Image):
            image, opened = value, False
        elif isinstance(value, dict):  # a datasets Image struct: {"bytes", "path"}
            data, path = value.get("bytes"), value.get("path")
            if data is None and path is None:
                raise MediaError(f"{where}: the image struct holds neither bytes nor a path")
            return open_image(data if data is not None else path, index=index, media_dir=media_dir,
                              max_pixels=max_pixels)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            image = _open(io.BytesIO(bytes(value)))
        elif isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if text.startswith("data:"):
                image = _open(io.BytesIO(base64.b64decode(text.split(",", 1)[1])))
            elif "://" in text:
                raise MediaError(
                    f"{where} is a URL ({text[:80]}); lossmask never fetches: put the image itself in the row "
                    "(a path, bytes or a PIL image, in the 'images' column or the part's 'image')")
            else:
                image = _open(_regular_file(text, media_dir, where))
        elif value is None:
            raise MediaError(f"{where}: an image part has no image (give the row's images in an 'images' column)")
        else:
            raise MediaError(f"{where}: cannot read an image from a {type(value).__name__}; pass a path, bytes or a PIL image")
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise MediaError(f"{where} is {width}x{height}, {width * height:,} pixels, over max_image_pixels="
                             f"{max_pixels:,}; shrink it, or raise max_image_pixels (--max-image-pixels)")
        image.load()
        if opened and image.getexif().get(EXIF_ORIENTATION, 1) != 1:
            from PIL import ImageOps

            image = ImageOps.exif_transpose(image)
    except MediaError:
        raise
    except Exception as exc:  # PIL's UnidentifiedImageError, a missing file, truncated bytes
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc})") from None
    return image


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

    def expected(self, replacements: Sequence[str]) -> int:
        """How many counted tokens the processor's replacement strings for one row's images hold."""
        return sum(r.count(t) for r in replacements for t in self.counted_text)

    def per_image(self, tok: Any, replacement: str) -> tuple[int, int, int]:
        """What one image writes into a row: its media tokens (its part, with the placeholder expanded; they are
        special tokens, so their number does not depend on the text around them), and how many tokens of plain text
        the part holds before its first media token and after its last: the processor's edge text (Gemma-3's blank
        lines; with pan-and-scan, "Here is the original image" before it) and the template's own (LLaVA's newline
        after ``<image>``). Every one of them is the image's."""
        cache = self.__dict__.setdefault("_per_image", {})
        if replacement not in cache:
            ids = set(self.ids)
            part = [int(t) in ids for t in tok.encode(self.part_text.replace(self.placeholder, replacement))]
            first = part.index(True) if any(part) else 0
            last = len(part) - 1 - part[::-1].index(True) if any(part) else len(part) - 1
            cache[replacement] = (sum(part), first, len(part) - 1 - last)
        return cache[replacement]

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
        renders = [tok.render(chat(*[image] * n)) for n in (0, 1, 2)]
    except Exception as exc:  # noqa: BLE001 - any failure means the handling cannot be verified
        raise MediaDetectionError(f"the chat template of {name!r} cannot render an image part ({exc})") from exc
    part = _inserted(renders[0], renders[1])
    if part is None or part.count(placeholder) != 1 or _inserted(renders[1], renders[2]) != part:
        raise MediaDetectionError(
            f"the chat template of {name!r} does not write the processor's image token {placeholder!r} once per "
            f"image part (it wrote {part!r} for one image); pass the processor whose template writes it, or "
            "chat_template= with one that does")
    from ..options import DEFAULT_MAX_MEDIA_TOKENS

    probe = estimated_tokens(processor, [probe_image()], {})
    if probe is not None and probe > DEFAULT_MAX_MEDIA_TOKENS:  # a config (min_pixels) that blows every image up
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
    # the processor's own tokenisation of a probe row must be lossmask's, media tokens and all
    text = renders[1]
    mine = tok.encode(text.replace(placeholder, replacements[0]))
    theirs = processor(text=[text], images=[[probe_image()]], add_special_tokens=False)["input_ids"][0]
    if list(map(int, theirs)) != list(map(int, mine)):
        raise MediaDetectionError(f"the processor of {name!r} tokenises an expanded image row differently from its "
                                  "tokenizer; lossmask cannot label its rows")
    return MediaTokens(placeholder, part, tuple(sorted(ids)), tuple(counted), counted_text)


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


def expand_rows(tok: Any, texts: Sequence[str], chats: Sequence[Any], given: Sequence[Any] | None,
                options: Any = None, *, keep_features: bool = False) -> ExpandedRows:
    """Open each row's images, check their number against the placeholders, and expand the placeholders.

    ``given``: per row, its images (the ``images`` column, or None). ``options`` (a ``MaskOptions``): where relative
    paths are read (``media_dir``), the keywords of every processor call (``processor_kwargs``) and the bounds
    (``max_image_pixels``, ``max_media_tokens``). With ``keep_features`` (a collator) all images of the batch go
    through the processor in one call and its outputs are kept; otherwise they go in groups of rows and only the
    replacement strings are kept. A row whose images cannot be used, or would make more than ``max_media_tokens``
    image tokens, is refused, named."""
    from ..options import MaskOptions

    options = options if options is not None else MaskOptions()
    kwargs = options.processor_call_kwargs()
    media = media_tokens(tok)
    out = list(texts)
    refused: list[tuple[int, str]] = []
    expected = np.zeros(len(texts), dtype=np.int64)
    per_image: list[list[tuple[int, int, int]]] = [[] for _ in texts]
    rows: list[tuple[int, list]] = []  # (row, its opened images)
    for k, (text, chat) in enumerate(zip(texts, chats)):
        messages = chat["messages"] if isinstance(chat, dict) else chat
        unsupported = other_media(messages)
        if unsupported:
            refused.append((k, f"a {unsupported!r} part: lossmask expands images only; drop the part or the row"))
            continue
        values = row_images(messages, given[k] if given is not None else None)
        slots = text.count(media.placeholder)
        if not values and not slots:
            continue
        if len(values) != slots:
            refused.append((k, f"{len(values)} image(s) given for {slots} image placeholder(s) "
                               f"{media.placeholder!r} in the rendered chat; give one image per image part"))
            continue
        try:
            opened = [open_image(v, index=i, media_dir=options.media_dir, max_pixels=options.max_image_pixels)
                      for i, v in enumerate(values)]
        except MediaError as exc:
            refused.append((k, str(exc)))
            continue
        estimate = estimated_tokens(tok.processor, opened, kwargs)
        if estimate is not None and estimate > options.max_media_tokens:
            refused.append((k, _over_bound(estimate, options.max_media_tokens)))
            continue
        rows.append((k, opened))
    features: dict = {}
    done: list[tuple[int, list[str]]] = []
    groups = [rows] if keep_features else [rows[i:i + IMAGE_GROUP_ROWS] for i in range(0, len(rows), IMAGE_GROUP_ROWS)]
    for group in groups:
        if not group:
            continue
        flat = [image for _, opened in group for image in opened]
        try:
            group_features, replacements = processor_images(tok.processor, flat, **kwargs)
        except Exception:  # noqa: BLE001 - some image the processor rejects: find its row, one row at a time
            for k, opened in group:
                try:
                    done.append((k, processor_images(tok.processor, opened, **kwargs)[1]))
                except Exception as exc:  # noqa: BLE001
                    refused.append((k, f"the processor cannot take its images ({type(exc).__name__}: {exc})"))
            continue
        if keep_features:
            features = dict(group_features)
        at = 0
        for k, opened in group:
            done.append((k, list(replacements[at:at + len(opened)])))
            at += len(opened)
    for k, row_replacements in done:
        made = media.expected(row_replacements)
        if made > options.max_media_tokens:
            refused.append((k, _over_bound(made, options.max_media_tokens)))
            continue
        pieces = out[k].split(media.placeholder)
        out[k] = pieces[0] + "".join(r + p for r, p in zip(row_replacements, pieces[1:]))
        expected[k] = made
        per_image[k] = [media.per_image(tok, r) for r in row_replacements]
    refused.sort()
    return ExpandedRows(out, refused, expected, features, sum(len(o) for _, o in rows), per_image)


IMAGE_GROUP_ROWS = 16  # rows whose images go through the processor in one call (when its outputs are not kept)


def estimated_tokens(processor: Any, images: Sequence[Any], kwargs: dict) -> int | None:
    """The image tokens the processor says it makes for ``images`` from their sizes alone, before any pixel is
    processed (``_get_num_multimodal_tokens``, where the processor has it; None where it has not)."""
    count = getattr(processor, "_get_num_multimodal_tokens", None)
    if count is None or not images:
        return None
    try:
        data = count(image_sizes=[(im.height, im.width) for im in images], **kwargs)
        return int(sum(getattr(data, "num_image_tokens", None) or data["num_image_tokens"]))
    except Exception:  # noqa: BLE001 - a processor whose count needs what it was not given: checked after
        return None


def _over_bound(tokens: int, bound: int) -> str:
    return (f"its images make {tokens:,} image tokens, over max_media_tokens={bound:,}; shrink the images, or raise "
            "max_media_tokens (--max-media-tokens)")


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


def other_media(messages: Sequence[Any]) -> str | None:
    """The type of the first video or audio part of a chat (None when it has none)."""
    for message in messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in OTHER_MEDIA:
                return part["type"]
    return None


def count_media(ids: np.ndarray, offsets: np.ndarray, counted: Sequence[int]) -> np.ndarray:
    """Per row, how many of its tokens are counted media tokens (``ids`` flat, ``offsets`` of len rows + 1)."""
    hit = np.isin(ids, np.asarray(counted, dtype=ids.dtype)).astype(np.int64)
    sums = np.concatenate([[0], np.cumsum(hit)])
    return sums[offsets[1:]] - sums[offsets[:-1]]

