"""Each token's character span in its row's text, from the bytes each id stands for (``kernels/token_spans.py``).

The engine's side of ``lossmask.chat.token_text``: that module reads which bytes a vocabulary's ids stand for; this
one lays a batch's ids against its texts in one kernel pass, with no per-token Python.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .kernels.token_spans import PADDING, pack_table
from .kernels.token_spans import token_spans as _kernel

__all__ = ["pack_table", "token_spans"]


def token_spans(meta: np.ndarray, pieces: np.ndarray, prepend: int, ids: np.ndarray, offsets: np.ndarray,
                texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(spans, exact)``: an ``(n, 2)`` int32 array of each token's ``[start, end)`` characters in its own text, and a
    bool per text (do its tokens' bytes, back to back, equal its bytes?). ``meta`` and ``pieces``: a vocabulary's
    ``pack_table``. See ``kernels/token_spans.py``."""
    # each text encoded on its own: joined first, one emoji would widen every character of the batch to 4 bytes
    encoded = [t.encode("utf-8") for t in texts]
    n_text = sum(map(len, encoded))
    encoded.append(bytes(PADDING))  # what the kernel's 8-byte loads may read past the last text
    text = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    char_lengths = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    ids = np.ascontiguousarray(ids)
    if ids.dtype not in (np.int32, np.int64):
        ids = ids.astype(np.int64)
    return _kernel(meta, pieces, np.int64(prepend), ids, np.ascontiguousarray(offsets, dtype=np.int64), text,
                   np.int64(n_text), char_lengths)
