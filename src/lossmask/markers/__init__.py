"""Markers from the chat template: derived, verified, and chosen by policy before any row is labelled.

``Markers`` themselves are the engine's input (``lossmask.engine.patterns``); this stage produces them.

- ``detect``: ``detect_markers`` reads them off the template's rendering of the probes;
- ``verify``: the ground truth of what must train, independent of any markers, and the check;
- ``content``: message text that quotes a marker (``find_marker_text``);
- ``templates``: the table of known templates, used only where it verifies;
- ``policy``: ``resolve_markers``, which of these a job uses, and why;
- ``cache``: resolved markers kept per tokenizer, so a job does not detect them twice.
"""

from ..engine.patterns import Markers
from .content import find_marker_text
from .detect import MarkerDetectionError, detect_markers, markers_from_strings
from .policy import (
    FullSequenceWarning,
    MarkerFallbackWarning,
    MarkerResolutionError,
    Resolution,
    UnverifiedMarkersWarning,
    resolve_markers,
)
from .templates import match_template
from .verify import VerifyReport, verify

__all__ = [
    "FullSequenceWarning", "MarkerDetectionError", "MarkerFallbackWarning", "MarkerResolutionError", "Markers",
    "Resolution", "UnverifiedMarkersWarning", "VerifyReport", "detect_markers", "find_marker_text",
    "markers_from_strings", "match_template", "resolve_markers", "verify",
]
