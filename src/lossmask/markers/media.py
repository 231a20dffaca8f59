"""Markers for a vision-language processor: the text markers, with every media token never trained.

The text markers are detected and verified from the processor's chat template like any other
(``detect``, ``verify``). Here the media tokens the processor writes (``chat.media.media_tokens``:
placeholder, expansion, begin and end tokens) join ``mask_out`` as one-token patterns, so that every
backend masks them wherever they stand, an image inside an assistant turn included; and the
result is checked on an image probe before any row is labelled:

- no marker pattern holds a media token (a marker could then open or close inside an image);
- with images in the user turns, exactly the same tokens train as without them;
- an image inside an assistant turn trains none of its media tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..chat.media import MediaDetectionError, media_tokens, probe_image, processor_images
from ..engine.labels import label_batch
from ..engine.patterns import Markers


def with_media(markers: Markers | None, tokenizer: Any) -> Markers | None:
    """``markers`` with the media tokens of ``tokenizer``'s processor added to ``mask_out`` (unchanged for a plain
    tokenizer, or for ``None``, which trains everything); ``MediaDetectionError`` when the probe disagrees."""
    if markers is None or not hasattr(markers, "response") or getattr(tokenizer, "processor", None) is None:
        return markers  # (labels from the rendering hold no patterns: a processor's media tokens are untrained by span)
    media = media_tokens(tokenizer)
    ids = set(media.ids)
    for kind in ("response", "instruction", "end"):
        for pattern in getattr(markers, kind):
            if ids & set(pattern):
                raise MediaDetectionError(
                    f"the {kind} marker {list(pattern)} of {tokenizer.name!r} holds a media token; a marker must not "
                    "lie inside an image. Pass markers= without media tokens")
    have = {tuple(p) for p in markers.mask_out}
    mask_out = tuple(markers.mask_out) + tuple((i,) for i in media.ids if (i,) not in have)
    lead = _leading_text(tokenizer, media)
    out = Markers(response=_variants(markers.response, tokenizer, lead),
                  instruction=_variants(markers.instruction, tokenizer, lead), end=markers.end, mask_out=mask_out)
    _check_probe(out, tokenizer, media)
    return out


def _leading_text(tok: Any, media: Any) -> str:
    """The plain text an image writes before its first special token (Gemma-3's expansion opens with a blank line)."""
    _, replacements = processor_images(tok.processor, [probe_image()])
    text = media.part_text.replace(media.placeholder, replacements[0])
    ids, offsets = tok.encode_with_offsets(text)
    first = next((k for k, i in enumerate(ids) if int(i) in media.ids), None)
    return text[:int(offsets[first][0])] if first is not None else ""


def _variants(patterns: tuple, tok: Any, lead: str) -> tuple:
    """``patterns`` and, for each one whose last token merges with the plain text an image opens with (a turn that
    starts with an image), the tokens that cover it in that context: the same marker, read as it occurs there."""
    if not lead:
        return patterns
    out = list(patterns)
    for pattern in patterns:
        text = tok.decode(pattern)
        ids, offsets = tok.encode_with_offsets(text + lead)
        cover = next((k + 1 for k in range(len(ids)) if offsets[k][1] >= len(text)), len(ids))
        variant = tuple(int(i) for i in ids[:cover])
        if variant != tuple(pattern) and variant not in out:
            out.append(variant)
    return tuple(out)


def _check_probe(markers: Markers, tok: Any, media: Any) -> None:
    a, b, c, d = "Qz7p1", "Qz7p2", "Qz7p3", "Qz7p4"
    image = {"type": "image"}

    def text(t):
        return {"type": "text", "text": t}

    plain = [{"role": "user", "content": [text(a)]}, {"role": "assistant", "content": [text(b)]},
             {"role": "user", "content": [text(c)]}, {"role": "assistant", "content": [text(d)]}]
    pictured = [{"role": "user", "content": [image, text(a)]}, {"role": "assistant", "content": [text(b)]},
                {"role": "user", "content": [text(c), image]}, {"role": "assistant", "content": [text(d)]}]
    answered = [{"role": "user", "content": [text(a)]}, {"role": "assistant", "content": [image, text(b)]}]
    rows = [_expand(tok, media, tok.render(chat)) for chat in (plain, pictured, answered)]
    labels = label_batch([np.asarray(r, dtype=np.int64) for r in rows], markers).labels
    labels = [np.asarray(row) for row in labels]
    trained = [ids[lab != -100] for ids, lab in zip(map(np.asarray, rows), labels)]
    if not np.array_equal(trained[0], trained[1]):
        raise MediaDetectionError(
            f"with images in the user turns, other tokens train on {tok.name!r} than without them; its template's image "
            "handling cannot be verified (pass markers= checked by hand)")
    if np.isin(trained[2], media.ids).any() or not trained[2].size:
        raise MediaDetectionError(f"an image inside an assistant turn of {tok.name!r} is not masked as lossmask expects")


def _expand(tok: Any, media: Any, text: str) -> list[int]:
    slots = text.count(media.placeholder)
    if not slots:
        return tok.encode(text)
    _, replacements = processor_images(tok.processor, [probe_image()] * slots)
    pieces = text.split(media.placeholder)
    return tok.encode(pieces[0] + "".join(r + p for r, p in zip(replacements, pieces[1:])))
