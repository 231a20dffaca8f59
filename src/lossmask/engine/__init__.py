"""The engine: token batches in, labels out.

It reads token ids as flat Arrow buffers and ``Markers`` as an automaton, makes one kernel call per
chunk, and says what each row ended as. It knows nothing of chats, templates or files.

- ``patterns``: ``Markers``, the four sets of token-id patterns, and their compiled form;
- ``automaton``: the patterns as the automaton the numba kernel runs;
- ``labels``: ``make_labels``, ``trainable_mask``, ``label_batch``: the public operations;
- ``buffers``: Arrow lists (or Python lists, or padded NumPy) to and from flat buffers, zero-copy;
- ``outcomes``: what a row ends as, why rows are dropped or rejected, and the counts;
- ``tally``: a job's running totals, batch by batch;
- ``turn_tokens``: assistant turns' character spans to the tokens that train, one compiled pass a batch (labels from
  the rendering, for rows read off a learnt conversation shape);
- ``kernels`` (the repository's ``kernels/``): numba, torch, MLX and the NumPy reference; this stage
  is the one that calls them, through ``get_backend``.
"""

from .kernels import BACKENDS, get_backend, one_thread
from .labels import LabelledBatch, label_batch, make_labels, trainable_mask
from .outcomes import Outcome, OutcomeCounts
from .patterns import CompiledMarkers, Markers
from .tally import Tally

__all__ = [
    "BACKENDS", "CompiledMarkers", "LabelledBatch", "Markers", "Outcome", "OutcomeCounts", "Tally",
    "get_backend", "label_batch", "make_labels", "one_thread", "trainable_mask",
]
