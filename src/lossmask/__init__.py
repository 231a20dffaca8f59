"""lossmask: which tokens of a chat training row count in the loss, exactly and fast.

    >>> import lossmask
    >>> markers = lossmask.Markers(response=[[1, 2]], instruction=[[1, 3]], end=[[4]])
    >>> lossmask.make_labels([[1, 3, 9, 4, 1, 2, 7, 8, 4]], markers)
    [[-100, -100, -100, -100, -100, -100, 7, 8, 4]]

``import lossmask`` loads numpy and pyarrow only; numba, torch, MLX, transformers and Ray load
when a function that needs them is first called.

The package reads as the data flow (docs/architecture.md): ``chat`` (chats to ids and a data mask),
``markers`` (markers derived and verified from the template), ``engine`` (ids to labels), ``jobs``
(files in, Parquet and a report out); the faces at the top (``hf``, ``ray``, ``mlx``, ``collator``,
``lora``, ``cli``, ``show``) connect them to the tools people train with.
"""

from __future__ import annotations

from .chat import ChatTokenizer, FromRendering, load_tokenizer
from .engine import LabelledBatch, Markers, Outcome, OutcomeCounts, label_batch, make_labels, trainable_mask
from .jobs import MaskReport, TooManyDroppedRows, check_drop_fraction, mask_files
from .markers import (
    FullSequenceWarning,
    MarkerDetectionError,
    MarkerFallbackWarning,
    MarkerResolutionError,
    Resolution,
    UnverifiedMarkersWarning,
    VerifyReport,
    detect_markers,
    find_marker_text,
    markers_from_strings,
    match_template,
    resolve_markers,
    verify,
)
from .options import MaskOptions

__version__ = "0.1.0"

__all__ = [
    "ChatTokenizer",
    "FromRendering",
    "FullSequenceWarning",
    "LabelledBatch",
    "MarkerDetectionError",
    "MarkerFallbackWarning",
    "MarkerResolutionError",
    "MaskOptions",
    "MaskReport",
    "Markers",
    "Outcome",
    "OutcomeCounts",
    "Resolution",
    "TooManyDroppedRows",
    "UnverifiedMarkersWarning",
    "VerifyReport",
    "check_drop_fraction",
    "detect_markers",
    "find_marker_text",
    "label_batch",
    "load_tokenizer",
    "make_labels",
    "markers_from_strings",
    "mask_files",
    "match_template",
    "resolve_markers",
    "trainable_mask",
    "verify",
]
