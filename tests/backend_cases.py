"""Hypothesis strategies shared by the backend property tests: a small vocabulary so that
patterns of every kind (lengths 1-5) match often, overlap and touch row edges."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

from lossmask import Markers

VOCAB = 5
patterns = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), max_size=3)


@st.composite
def markers(draw) -> Markers:
    return Markers(
        response=draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=3)),
        instruction=draw(patterns),
        end=draw(patterns),
        mask_out=draw(patterns),
    )


rows = st.lists(st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), max_size=40)), max_size=8)
value_types = st.sampled_from([pa.int32(), pa.int64()])


def as_arrow(batch, value_type) -> pa.Array:
    return pa.array(batch, type=pa.list_(value_type))


def padded(batch) -> tuple[np.ndarray, np.ndarray]:
    """Rows right-padded with the id 0 (a real, often-matching id) and their lengths."""
    batch = [r or [] for r in batch]
    lengths = np.array([len(r) for r in batch], dtype=np.int64)
    width = int(lengths.max()) if batch and lengths.max() else 1
    ids = np.zeros((len(batch), width), dtype=np.int64)
    for r, row in enumerate(batch):
        ids[r, : len(row)] = row
    return ids, lengths
