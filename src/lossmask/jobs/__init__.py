"""Jobs: files (or datasets) in, masked Parquet and a report out, nothing lost on the way.

- ``inputs``: reading Parquet, JSON Lines and JSON files as Arrow batches, errors naming file and row;
- ``batch_step``: the per-batch step every path shares (files, Hugging Face datasets, Ray):
  encode, label, drop and count;
- ``stream``: ``mask_files``, the streaming job: read, render, tokenise, label and write, overlapped;
- ``outputs``: writing beside the output and committing it whole, or leaving nothing;
- ``report``: ``MaskReport``, what came in, what went out, and why every missing row is missing;
- ``safety``: the dropped-row safety net;
- ``display``: labelled rows as text a person reads.
"""

from .report import MaskReport
from .safety import TooManyDroppedRows, check_drop_fraction
from .stream import mask_files

__all__ = ["MaskReport", "TooManyDroppedRows", "check_drop_fraction", "mask_files"]
