"""Chat rows with images (and videos) to token ids: ``encode_table`` through a processor (``media.py`` says what it
expands).

``encode_rows`` is what the batch step calls for rows to render: chat rows through a processor take
``encode_media_table``, everything else ``encode_batch.encode_table`` as before.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .encode_batch import chat_tokenizer, encode_table, render_table, tokenize_rendered
from .media import count_media, expand_rows, media_spans, media_tokens


def encode_rows(tokenizer: Any, table: Any, kind: str, options: Any, *, first_row: int = 0, markers: Any = "unknown"):
    """``encode_table``, with chat rows through a processor expanded as it expands their images."""
    tok = chat_tokenizer(tokenizer)
    if kind == "messages" and tok.processor is not None:
        return encode_media_table(tok, table, options, first_row=first_row, markers=markers)
    return encode_table(tok, table, kind, options, first_row=first_row, markers=markers)


IMAGES_COLUMN = "images"
VIDEOS_COLUMN = "videos"  # per row, its videos: each a list of frames (Qwen2-VL, Qwen2.5-VL)


def encode_media_table(tok: Any, table: Any, options: Any, *, first_row: int = 0, markers: Any = "unknown",
                       images: Sequence[Any] | None = None, keep_features: bool = False):
    """``encode_batch.encode_table`` for chat rows through a processor: rendered as any chat, each image placeholder
    expanded as the processor expands it, then tokenised as any chat (message text kept as data).

    A row whose images cannot be used is ``invalid``, named. The number of counted media tokens in each row must be
    what the processor produced for its images: a mismatch (a ``max_length`` that cuts an image) raises, naming the
    row. A video part (Qwen2-VL, Qwen2.5-VL: a list of frames, in the part's ``video`` or the ``videos`` column) is
    expanded as the processor expands it, its tokens counted from its frames' sizes (``media.VideoGrid``). Rows without
    images or videos are encoded exactly as without a processor. With ``keep_features`` (a collator), the
    processor's image outputs for the rows' images (``pixel_values``...) are kept on the result as ``media``."""
    import dataclasses
    import time

    rendered = render_table(tok, table, "messages", options, first_row=first_row)
    started = time.perf_counter()
    given = None
    if images is None and IMAGES_COLUMN in table.column_names:
        images = table.column(IMAGES_COLUMN).to_pylist()
    if images is not None:  # per row of the table: its images (given by a collator, or the column)
        given = [images[r - first_row] for r in rendered.rows]
    videos = None
    if VIDEOS_COLUMN in table.column_names:
        column = _videos(table.column(VIDEOS_COLUMN))
        videos = [column[r - first_row] for r in rendered.rows]
    expanded = expand_rows(tok, rendered.texts, rendered.chats, given, options, keep_features=keep_features,
                           given_videos=videos)
    errors = list(rendered.errors)
    valid = rendered.valid.copy()
    texts, chats, rows, check, expected = expanded.texts, list(rendered.chats), list(rendered.rows), rendered.check, expanded.expected
    per_image = expanded.per_image
    if expanded.refused:
        gone = {k for k, _ in expanded.refused}
        errors += [(rows[k], message) for k, message in expanded.refused]
        errors.sort()
        for k in gone:
            valid[rows[k] - first_row] = False
        keep = [k for k in range(len(texts)) if k not in gone]
        texts, chats, rows = [texts[k] for k in keep], [chats[k] for k in keep], [rows[k] for k in keep]
        per_image = [per_image[k] for k in keep]
        check = [check[k] for k in keep] if check is not None else None
        expected = expected[keep]
    seconds = {**rendered.seconds, "images": time.perf_counter() - started}
    rendered = dataclasses.replace(rendered, texts=texts, chats=chats, rows=rows, valid=valid, errors=errors,
                                   check=check, seconds=seconds)
    encoded = tokenize_rendered(tok, rendered, options, markers=markers)
    ids = encoded.input_ids
    kept = encoded.valid[np.asarray(rows, dtype=np.int64) - first_row] if rows else np.zeros(0, dtype=bool)
    media = media_tokens(tok)
    found = count_media(ids.values.to_numpy(zero_copy_only=False), ids.offsets.to_numpy(), media.counted)
    want = expected[kept]
    if found.shape != want.shape or (found != want).any():
        bad = int(np.flatnonzero(found != want)[0])
        row = np.asarray(rows)[kept][bad]
        what = "images and videos" if media.video_placeholder else "images"
        raise ValueError(
            f"row {row}: {found[bad]} image tokens {media.counted_text} in its token ids, but the processor made "
            f"{want[bad]} for its {what} (max_length={options.max_length} may cut an image: raise it, or leave it "
            "unset)")
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
    spans = media_spans(values, offsets - offsets[0], media.ids, [c for c, k in zip(per_image, kept) if k],
                        blank=lambda token: media.blank(tok, token))
    return dataclasses.replace(encoded, media=expanded.features, media_ids=media.ids, media_span=spans)


def _videos(column: Any) -> list:
    """The ``videos`` column as Python lists: where a reader kept its entries as JSON text (a JSON Lines file's lists of
    frame paths), each is read back."""
    import json

    values = column.to_pylist()
    kind = column.type
    if getattr(kind, "extension_name", None) == "arrow.json":  # the row's whole list as JSON
        return [json.loads(v) if isinstance(v, str) else v for v in values]
    if hasattr(kind, "value_type") and getattr(kind.value_type, "extension_name", None) == "arrow.json":
        return [[json.loads(v) if isinstance(v, str) else v for v in row] if row else row for row in values]
    return values
