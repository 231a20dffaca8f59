"""lossmask: which tokens of a chat training row count in the loss, exactly and fast.

    >>> import lossmask
    >>> markers = lossmask.Markers(response=[[1, 2]], instruction=[[1, 3]], end=[[4]])
    >>> lossmask.make_labels([[1, 3, 9, 4, 1, 2, 7, 8, 4]], markers)
    [[-100, -100, -100, -100, -100, -100, 7, 8, 4]]

``import lossmask`` loads numpy and pyarrow only; numba, torch, MLX, transformers and Ray load
when a function that needs them is first called.
"""

from __future__ import annotations

from .content import find_marker_text
from .detect import MarkerDetectionError, detect_markers, markers_from_strings
from .labels import LabelledBatch, label_batch, make_labels, trainable_mask
from .markers import Markers
from .options import MaskOptions
from .outcomes import Outcome, OutcomeCounts
from .policy import (
    FullSequenceWarning,
    MarkerFallbackWarning,
    MarkerResolutionError,
    Resolution,
    UnverifiedMarkersWarning,
    resolve_markers,
)
from .report import MaskReport
from .safety import TooManyDroppedRows, check_drop_fraction
from .stream import mask_files
from .templates import match_template
from .tokenizer import ChatTokenizer, load_tokenizer
from .verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "ChatTokenizer",
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
