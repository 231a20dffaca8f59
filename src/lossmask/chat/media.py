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
opened here (paths, bytes, ``{"bytes", "path"}`` structs, PIL images, ``data:`` URLs); a web URL is
never fetched.

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


def open_image(value: Any, *, index: int) -> Any:
    """A PIL image, RGB, from what a row holds; ``MediaError`` naming the image when it cannot be opened."""
    from PIL import Image

    where = f"image {index}"  # the row is named by whoever reports it
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict):  # a datasets Image struct: {"bytes", "path"}
            data, path = value.get("bytes"), value.get("path")
            if data is None and path is None:
                raise MediaError(f"{where}: the image struct holds neither bytes nor a path")
            return open_image(data if data is not None else path, index=index)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            image = Image.open(io.BytesIO(bytes(value)))
        elif isinstance(value, (str, os.PathLike)):
            text = os.fspath(value)
            if text.startswith("data:"):
                image = Image.open(io.BytesIO(base64.b64decode(text.split(",", 1)[1])))
            elif "://" in text:
                raise MediaError(
                    f"{where} is a URL ({text[:80]}); lossmask never fetches: put the image itself in the row "
                    "(a path, bytes or a PIL image, in the 'images' column or the part's 'image')")
            else:
                image = Image.open(text)
        elif value is None:
            raise MediaError(f"{where}: an image part has no image (give the row's images in an 'images' column)")
        else:
            raise MediaError(f"{where}: cannot read an image from a {type(value).__name__}; pass a path, bytes or a PIL image")
        image.load()
    except MediaError:
        raise
    except Exception as exc:  # PIL's UnidentifiedImageError, a missing file, truncated bytes
        raise MediaError(f"{where} cannot be opened ({type(exc).__name__}: {exc})") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def probe_image():
    """A small image for the probes: big enough for every processor's smallest grid."""
    from PIL import Image

    return Image.new("RGB", (56, 56), (128, 64, 32))


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

    def per_image(self, tok: Any, replacement: str) -> tuple[int, bool, bool]:
        """What one image writes into a row: its media tokens (its part, with the placeholder expanded; they are
        special tokens, so their number does not depend on the text around them), and whether the expansion begins,
        and ends, with plain text (Gemma-3's blank lines) rather than a media token: the processor's own expansion,
        not the text the template writes around the part (LLaVA's newline after ``<image>``)."""
        cache = self.__dict__.setdefault("_per_image", {})
        if replacement not in cache:
            ids = set(self.ids)
            part = [int(t) in ids for t in tok.encode(self.part_text.replace(self.placeholder, replacement))]
            own = [int(t) in ids for t in tok.encode(replacement)]
            cache[replacement] = (sum(part), bool(own) and not own[0], bool(own) and not own[-1])
        return cache[replacement]


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
    """The processor's own image step: ``(features, replacement string per image)``, images flat, in order."""
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
    per_image: list[list[tuple[int, bool, bool]]] = field(default_factory=list)


def expand_rows(tok: Any, texts: Sequence[str], chats: Sequence[Any], given: Sequence[Any] | None) -> ExpandedRows:
    """Open each row's images, check their number against the placeholders, and expand the placeholders.

    ``given``: per row, its images (the ``images`` column, or None). All images of the batch go through the
    processor in one call."""
    media = media_tokens(tok)
    out = list(texts)
    refused: list[tuple[int, str]] = []
    expected = np.zeros(len(texts), dtype=np.int64)
    per_image: list[list[tuple[int, bool, bool]]] = [[] for _ in texts]
    flat, owners = [], []
    for k, (text, chat) in enumerate(zip(texts, chats)):
        messages = chat["messages"] if isinstance(chat, dict) else chat
        unsupported = _other_media(messages)
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
            opened = [open_image(v, index=i) for i, v in enumerate(values)]
        except MediaError as exc:
            refused.append((k, str(exc)))
            continue
        flat.extend(opened)
        owners.extend([k] * len(opened))
    features: dict = {}
    if flat:
        features, replacements = processor_images(tok.processor, flat)
        by_row: dict[int, list[str]] = {}
        for k, replacement in zip(owners, replacements):
            by_row.setdefault(k, []).append(replacement)
        for k, row_replacements in by_row.items():
            pieces = out[k].split(media.placeholder)
            out[k] = pieces[0] + "".join(r + p for r, p in zip(row_replacements, pieces[1:]))
            expected[k] = media.expected(row_replacements)
            per_image[k] = [media.per_image(tok, r) for r in row_replacements]
    return ExpandedRows(out, refused, expected, dict(features), len(flat), per_image)


def media_spans(ids: np.ndarray, offsets: np.ndarray, media_ids: Sequence[int],
                per_image: Sequence[Sequence[tuple[int, bool, bool]]]) -> np.ndarray:
    """A bool per token (``ids`` flat, ``offsets`` per row): True from each image's first media token to its last,
    and on the token just before (after) it where the expansion begins (ends) with plain text. Media tokens are
    special, so the tokeniser splits at them: that token holds the edge's text (merged, at most, with a neighbour's
    whitespace: Gemma-3's ``model\n`` + blank line is ``model`` + ``\n\n\n``).

    ``per_image``: per row, ``(media tokens, plain start, plain end)`` of each of its images, in order
    (``ExpandedRows.per_image``). A row whose media tokens are not that many (never after the count check) raises."""
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
        np.add.at(span, starts, 1)
        np.add.at(span, stops, -1)
    return np.cumsum(span[:-1]) > 0



OTHER_MEDIA = ("video", "video_url", "audio", "input_audio")


def _other_media(messages: Sequence[Any]) -> str | None:
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

