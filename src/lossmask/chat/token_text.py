"""Each token's character span in its text, read off the ids: the text every id stands for, checked against the text.

Placing message text on tokens needs each token's character span. Hugging Face ``tokenizers`` gives spans only from
``encode_batch``, which on long rows costs 20-70 times the ids-only call of the fast tokeniser (2,000 ShareGPT
conversations on Qwen2.5: 2.3 s against 0.03-0.1 s). But on the vocabularies people train with, a token stands for
fixed bytes, and a row's tokens, back to back, are the row's text:

- byte-level BPE (``ByteLevel`` decoder: Qwen, Llama-3, gpt-oss, DeepSeek...): each character of a token's string
  stands for one byte (GPT-2's byte-to-character table, inverted here);
- SentencePiece-style BPE (a decoder that turns ``▁`` back into a space, with byte fallback: Llama-2, Mistral, Gemma):
  ``▁`` is a space and ``<0xNN>`` is byte NN. Where the normaliser or pre-tokeniser prepends a ``▁`` (to the row,
  or to every stretch between added tokens), that space is in the tokens but not in the text, and is taken off;
- added tokens (special or not) stand for their content (``▁`` a space in them too, on SentencePiece-style
  vocabularies). One that swallows the spaces beside it (``lstrip``/``rstrip``: Phi-3's role
  tokens) does not stand for fixed bytes, and its rows are left to ``tokenizers``.

``TokenText.spans`` lays the bytes of a batch's ids back to back and compares them with the texts, byte for byte:
a row whose bytes differ anywhere (a normaliser that rewrote it: NFC on text that was not in NFC, an added token
that strips the spaces around it) is reported, and its spans are left for the caller to take from ``tokenizers``.
A token's span is the characters its bytes lie in (a token holding part of a character's bytes covers that character).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

_SPACE_MARK = "\u2581"  # SentencePiece's "▁"
# Where a "▁" that is not in the text is written (as kernels/token_spans.py takes it): before the row's first token,
# before the first of every stretch between added tokens; or'ed with: not before text that begins with a space.
_ROW, _SEGMENTS, _UNLESS_SPACE = 1, 2, 4


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's table, inverted: the printable character each byte is written as in a byte-level vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _kind(spec: dict | None, key: str) -> list[dict]:
    """The steps of a normaliser, pre-tokeniser or decoder spec (a ``Sequence`` unpacked)."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        return [step for inner in spec.get(key, []) for step in _kind(inner, key)]
    return [spec]


@dataclass(frozen=True)
class TokenText:
    """The bytes each id of one vocabulary stands for, which ids are added tokens and the characters each piece
    begins, packed as the kernel reads them (``meta`` and ``pieces``: ``engine.token_spans.pack_table``), and where a
    ``▁`` is prepended (``prepend``: ``_ROW``, ``_SEGMENTS``, or'ed with ``_UNLESS_SPACE``; 0 for none)."""

    meta: np.ndarray
    pieces: np.ndarray
    prepend: int

    @classmethod
    def of(cls, tokenizer_json: str, added_ids: Sequence[int]) -> "TokenText | None":
        """The table of a ``tokenizer.json``, or None where a token's text cannot be read off its string (a decoder
        other than byte-level or SentencePiece-style, or a model without a vocabulary table)."""
        spec = json.loads(tokenizer_json)
        model = spec.get("model") or {}
        vocab = model.get("vocab")
        if model.get("type") != "BPE" or not isinstance(vocab, dict):
            return None
        decoders = {step.get("type") for step in _kind(spec.get("decoder"), "decoders")}
        byte_level = "ByteLevel" in decoders
        if byte_level:
            table = _byte_level_chars()

            def text_of(token: str) -> bytes | None:
                try:
                    return bytes(table[c] for c in token)
                except KeyError:
                    return None
        elif "Replace" in decoders and "ByteFallback" in decoders:
            def text_of(token: str) -> bytes | None:
                if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    return bytes([int(token[3:5], 16)])
                return token.replace(_SPACE_MARK, " ").encode("utf-8")
        else:
            return None
        prepend = 0
        if any(step.get("type") == "Prepend" for step in _kind(spec.get("normalizer"), "normalizers")):
            prepend = _SEGMENTS
        for step in _kind(spec.get("pre_tokenizer"), "pretokenizers"):
            if step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never":
                # Metaspace writes no "▁" before text that already begins with one
                prepend = (_ROW if step.get("prepend_scheme") == "first" else _SEGMENTS) | _UNLESS_SPACE
        size = max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", [])), -1]) + 1
        pieces: list[bytes] = [b""] * size
        known = np.zeros(size, dtype=bool)
        for token, i in vocab.items():
            piece = text_of(token)
            if piece is not None:
                pieces[i], known[i] = piece, True
        for token in spec.get("added_tokens", []):
            # SentencePiece-style: "▁" in an added token's content is a space there too (Gemma's runs of "▁" are
            # added tokens that the model's own merges produce from spaces)
            piece = None if byte_level else text_of(token["content"])
            pieces[token["id"]], known[token["id"]] = piece or token["content"].encode("utf-8"), True
        lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=size)
        lengths[~known] = -1  # an id whose text is unknown: its row is never exact
        starts = np.zeros(size, dtype=np.int64)
        np.cumsum(np.maximum(lengths, 0)[:-1], out=starts[1:])
        added = np.zeros(size, dtype=bool)
        added[[i for i in added_ids if 0 <= i < size]] = True
        data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
        # the characters each piece begins: its bytes that are not UTF-8 continuation bytes
        begins = np.concatenate([[0], np.cumsum((data & 0xC0) != 0x80)])
        chars = begins[starts + np.maximum(lengths, 0)] - begins[starts]
        from ..engine.token_spans import pack_table

        packed = pack_table(data, starts, lengths, chars, added)
        return cls(*packed, prepend) if packed is not None else None

    def spans(self, texts: Sequence[str], ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(spans, exact)``: each token's ``[start, end)`` characters in its own text (an ``(n, 2)`` int32 array,
        ``ids[offsets[r]:offsets[r + 1]]`` being text ``r``'s tokens), and a bool per text: do its tokens' bytes,
        back to back, equal its bytes? The spans of a row that is not exact mean nothing."""
        from ..engine.token_spans import token_spans

        return token_spans(self.meta, self.pieces, self.prepend, ids, offsets, texts)
