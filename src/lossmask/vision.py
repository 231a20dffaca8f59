"""A collator for vision-language chats: pixel values from the processor, labels from lossmask.

``VisionCollator(processor)`` is a ``data_collator`` for TRL's ``SFTTrainer`` and ``transformers.Trainer``.
Each example is a chat (``messages``, content parts with ``{"type": "image"}``) and its images
(``images``: PIL images, paths, bytes; or the image inside each part). Per batch it:

1. renders the chats with the processor's chat template and expands every image as the processor
   does (``chat/media.py``), running the processor's image step once for the batch's images, with
   ``options.processor_kwargs`` (Gemma-3's ``do_pan_and_scan``) and each image in its own mode (the processor
   composites alpha onto white itself), EXIF orientation applied to images opened from paths or bytes;
2. tokenises them as lossmask does for any chat (message text kept as data) and labels them with the
   markers detected and verified from the processor's template, every media token masked
   (``markers/media.py``);
3. pads (right, or left) and returns the fields the processor returns for the same rows, equal to its own, plus
   ``labels``: ``input_ids``, ``attention_mask``, the image outputs the model takes (``pixel_values``,
   ``image_grid_thw``, ...), ``mm_token_type_ids`` / ``token_type_ids`` and Mllama's ``cross_attention_mask`` where
   the processor's model takes them.

With TRL: ``SFTConfig(remove_unused_columns=False, dataset_kwargs={"skip_prepare_dataset": True})`` so that the
raw chats and images reach the collator, as TRL documents for vision models.

A row whose image cannot be opened, or whose image tokens do not match what the processor made, raises
here naming the row (a trainer cannot skip a row of a batch); label the dataset first with
``lossmask.hf.mask_dataset`` to have such rows counted and removed.

Importing this module imports torch; ``import lossmask`` does not import this module.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import torch

from .chat.media import VIDEO_NO_PROCESSOR, image_parts, is_image_part, part_image, video_parts
from .chat.shapes import read_placeholders
from .chat.turn_spans import breaks_message, role_breaks
from .engine.labels import label_batch
from .engine.patterns import Markers
from .options import MaskOptions

TEXT_OUTPUTS = ("input_ids", "attention_mask", "labels")


class VisionCollator:
    """Pads and labels vision-language chats per SPEC.md, every media token masked (see the module text).

    ``processor``: a Hugging Face processor (or its folder); ``markers``: given markers (default: detected from the
    processor's template); ``options``/keywords: a ``MaskOptions`` (``max_length``, ``last_turn_only``,
    ``ignore_index``...); ``padding_side``: ``"right"`` or ``"left"``; ``pad_to_multiple_of``.
    """

    def __init__(self, processor: Any, *, markers: Markers | dict | str | None = None, model_name: str | None = None,
                 options: MaskOptions | None = None, padding_side: str = "right", pad_to_multiple_of: int | None = None,
                 **option_fields: Any):
        from .jobs.stream import load_chat_tokenizer, resolve_job_markers

        if padding_side not in ("right", "left"):
            raise ValueError(f"padding_side={padding_side!r}; pass 'right' or 'left'")
        self.options = MaskOptions.resolve(options, **option_fields)
        self.chat = load_chat_tokenizer(processor)
        if self.chat.processor is None:
            raise TypeError(f"VisionCollator needs a processor with an image processor, got {type(processor).__name__}; "
                            "for text-only rows use lossmask.collator.CompletionCollator")
        self.processor = self.chat.processor
        self.markers, self.markers_source, _ = resolve_job_markers(markers, tokenizer=self.chat, model_name=model_name,
                                                                   strict=False)
        if self.markers is None:
            raise ValueError("no markers: the processor's template could not be read; pass markers=")
        self.padding_side = padding_side
        self.pad_to_multiple_of = pad_to_multiple_of
        pad = self.chat.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (self.chat.eos_token_id or 0))
        names = list(getattr(self.processor, "model_input_names", ()) or ())
        self.type_ids_name = next((n for n in ("token_type_ids", "mm_token_type_ids") if n in names), None)
        # the image outputs the processor returns: those its model takes (it drops Gemma-3's num_crops, Idefics3's
        # rows and cols, Mllama's num_tiles, which only count tokens or build another field)
        self.input_names = frozenset(names)

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        from .chat.encode_media import encode_media_table

        chats, images = [], []
        for r, example in enumerate(examples):
            if video_parts(example["messages"]) or example.get("videos"):
                why = VIDEO_NO_PROCESSOR if getattr(self.processor, "video_processor", None) is None else \
                    "VisionCollator makes no pixel_values_videos"
                raise ValueError(f"VisionCollator: row {r} of the batch has a video; {why}. Label video rows with "
                                 "lossmask.hf.mask_dataset (their ids and labels), or drop them")
            messages, row_images = _split_images(example["messages"], example.get("images"))
            # LLaMA-Factory's rows: <image> in a string content where each image of ``images`` goes, read as parts,
            # as hf.mask_dataset reads them
            read = [messages]
            unread = read_placeholders(read, {"images": [len(row_images)]}, processor=True) if row_images else []
            if unread:
                raise ValueError(f"VisionCollator: row {r} of the batch {unread[0][1]}")
            messages = read[0]
            chats.append({"messages": messages})
            images.append(row_images)
        try:
            table = pa.Table.from_pylist(chats)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # messages of mixed shapes (string and list content): as JSON
            table = pa.table({"messages": [[json.dumps(m) for m in chat["messages"]] for chat in chats]})
        encoded = encode_media_table(self.chat, table, self.options, images=images, keep_features=True)
        if encoded.errors or not encoded.valid.all():
            row, detail = encoded.errors[0] if encoded.errors else encoded.dropped[0][::2] if encoded.dropped else (-1, "?")
            detail = f"row {row}: {detail}"
            raise ValueError(f"VisionCollator: a row of the batch cannot be labelled ({detail}); label the dataset with "
                             "lossmask.hf.mask_dataset first to have such rows counted and removed")
        ids = encoded.input_ids
        result = label_batch(ids, self.markers, backend=self.options.backend, last_turn_only=self.options.last_turn_only,
                             ignore_index=self.options.ignore_index, dtype="int64", data_mask=encoded.in_content)
        offsets = ids.offsets.to_numpy()
        flat_ids = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
        flat_labels = result.labels.values.to_numpy(zero_copy_only=False).astype(np.int64)
        if encoded.media_span is not None:  # an image's tokens, plain text between them too, never train
            flat_labels[encoded.media_span] = self.options.ignore_index
        _check_roles(encoded, flat_labels != self.options.ignore_index, offsets, self.options.last_turn_only)
        lengths = np.diff(offsets)
        width = int(lengths.max()) if len(lengths) else 0
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        n = len(lengths)
        input_ids = np.full((n, width), self.pad_token_id, dtype=np.int64)
        labels = np.full((n, width), self.options.ignore_index, dtype=np.int64)
        attention = np.zeros((n, width), dtype=np.int64)
        for r in range(n):  # one slice per row: the batch is a handful of rows
            start, end = int(offsets[r]), int(offsets[r + 1])
            at = slice(0, end - start) if self.padding_side == "right" else slice(width - (end - start), width)
            input_ids[r, at] = flat_ids[start:end]
            labels[r, at] = flat_labels[start:end]
            attention[r, at] = 1
        batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(attention),
                 "labels": torch.from_numpy(labels)}
        media = encoded.media or {}
        for name, value in media.items():
            if name not in batch and value is not None and (not self.input_names or name in self.input_names):
                batch[name] = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
        if CROSS_ATTENTION in self.input_names and media.get("num_tiles") is not None:
            batch[CROSS_ATTENTION] = torch.from_numpy(cross_attention_mask(
                input_ids, self.chat.tokenizer.convert_tokens_to_ids(self.processor.image_token), media["num_tiles"],
                self.processor.image_processor.max_image_tiles))
        if self.type_ids_name is not None:
            types = self.processor.create_mm_token_type_ids(input_ids.tolist())
            batch[self.type_ids_name] = torch.as_tensor(np.asarray(types, dtype=np.int64)) * batch["attention_mask"]
        return batch


CROSS_ATTENTION = "cross_attention_mask"


def cross_attention_mask(ids: np.ndarray, image_id: int, num_tiles: Sequence[Sequence[int]], max_tiles: int) -> np.ndarray:
    """Mllama's ``cross_attention_mask`` for a padded batch ``ids`` ``[rows, width]``, as its processor builds it from
    the same ids: ``[rows, width, images, max_tiles]`` int64, 1 where a token sees a tile of an image. Each
    ``image_id`` token's image is seen from that token up to the row's next image token, the last one to the end of
    the row (padding included); consecutive image tokens are one group, each seen to the group's end. An image sees
    only its own ``num_tiles[row][k]`` tiles. NumPy over the whole batch (transformers' own builds it row by row)."""
    rows, width = ids.shape
    row, col = np.nonzero(ids == image_id)  # row-major: each row's image tokens in order
    counts = np.bincount(row, minlength=rows)
    out = np.zeros((rows, width, int(counts.max(initial=0)), max_tiles), dtype=np.int64)
    if row.size == 0:
        return out
    index = np.arange(row.size) - np.repeat(np.cumsum(counts) - counts, counts)  # the image's place in its row
    same_row = np.append(row[1:] == row[:-1], False)
    end = np.where(same_row, np.append(col[1:], width), width)
    # a token followed at once by another image token sees as far as that one: the group's last end, for all of it
    starts_group = np.ones(row.size, dtype=bool)
    starts_group[1:] = ~(same_row[:-1] & (col[1:] == col[:-1] + 1))
    group = np.cumsum(starts_group) - 1
    end = end[np.append(starts_group[1:], True)][group]
    tiles = np.asarray([t for per_row in num_tiles for t in per_row], dtype=np.int64)
    if tiles.size != row.size:
        raise ValueError(f"{row.size} image tokens in the batch's ids, {tiles.size} images in num_tiles")
    position = np.arange(width)
    seen = (position[None, :] >= col[:, None]) & (position[None, :] < end[:, None])
    out[row, :, index, :] = (seen[:, :, None] & (np.arange(max_tiles)[None, None, :] < tiles[:, None, None]))
    return out


def _check_roles(encoded: Any, trained: np.ndarray, offsets: np.ndarray, last_turn_only: bool) -> None:
    """The role invariant, as ``mask_files`` holds rows to it: a row of the batch whose labels train user, system or
    tool text, or leave an assistant's text untrained (its images aside), is refused, naming the row. A collator
    cannot drop a row or render it again; ``hf.mask_dataset`` labels such rows from their rendering, or counts them."""
    roles = encoded.roles
    if roles is None or not roles.role.any():
        return
    bad = role_breaks(trained, roles, last_turn_only)
    if encoded.media_span is not None:
        bad &= ~encoded.media_span
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(offsets, at, side="right")) - 1
        raise ValueError(f"VisionCollator: row {row} of the batch: {breaks_message(roles, at, int(offsets[row]))}. "
                         "Label the dataset with lossmask.hf.mask_dataset first: it labels such rows from their "
                         "rendering, or counts and removes them")


def _split_images(messages: Any, given: Any) -> tuple[list, list]:
    """The messages with each image part reduced to ``{"type": "image"}``, and the row's images (``given``, else those
    the parts carried); images stay out of the Arrow table the chats are rendered from."""
    inline = [part_image(part) for part in image_parts(messages)]
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": [{"type": "image"} if is_image_part(part) else part for part in content]}
        out.append(message)
    if given is not None and not isinstance(given, (list, tuple)):
        given = [given]
    return out, list(given) if given else inline
