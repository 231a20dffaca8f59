"""Each token's character span in its row's text, from the bytes each id stands for (``kernels/token_spans.py``).

The engine's side of ``lossmask.chat.token_text``: that module reads which bytes a vocabulary's ids stand for; this
one lays a batch's ids against its texts in one kernel pass, with no per-token Python.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from .kernels.token_spans import pack_table
from .kernels.token_spans import token_spans as _kernel

__all__ = ["pack_table", "token_spans"]


def token_spans(meta: np.ndarray, pieces: np.ndarray, prepend: int, ids: np.ndarray, offsets: np.ndarray,
                texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(spans, exact)``: an ``(n, 2)`` int32 array of each token's ``[start, end)`` characters in its own text, and a
    bool per text (do its tokens' bytes, back to back, equal its bytes?). ``meta`` and ``pieces``: a vocabulary's
    ``pack_table``. See ``kernels/token_spans.py``."""
    # Arrow writes the texts' UTF-8 into one buffer with their byte offsets in one pass (each text's own width:
    # one emoji does not widen the rest, as joining Python strings would)
    array = pa.array(texts, type=pa.large_string())
    _, offsets_buffer, data_buffer = array.buffers()
    text_offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[:len(array) + 1]
    text = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.zeros(0, np.uint8)
    ids = np.ascontiguousarray(ids)
    if ids.dtype not in (np.int32, np.int64):
        ids = ids.astype(np.int64)
    return _kernel(meta, pieces, np.int64(prepend), ids, np.ascontiguousarray(offsets, dtype=np.int64), text,
                   text_offsets)
