"""Shared fixtures. The real tokenizers live outside the repo, in ``$LOSSMASK_TOKENIZERS``
(default ``../shared/tokenizers`` beside the repo root); tests that need them skip when absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TOKENIZERS_DIR = Path(os.environ.get("LOSSMASK_TOKENIZERS", REPO_ROOT.parent / "shared" / "tokenizers"))


def tokenizer_families() -> list[str]:
    """Every tokenizer folder in TOKENIZERS_DIR (empty when the folder is absent)."""
    if not TOKENIZERS_DIR.is_dir():
        return []
    return sorted(p.name for p in TOKENIZERS_DIR.iterdir() if (p / "tokenizer_config.json").is_file())


def tokenizer_path(family: str) -> Path:
    """The folder of one family's tokenizer, or a skip naming what is missing."""
    path = TOKENIZERS_DIR / family
    if not path.is_dir():
        pytest.skip(f"tokenizer {family!r} not found in {TOKENIZERS_DIR} (set LOSSMASK_TOKENIZERS to the shared tokenizers folder)")
    return path


@pytest.fixture(scope="session")
def tokenizers_dir() -> Path:
    if not TOKENIZERS_DIR.is_dir():
        pytest.skip(f"shared tokenizers not found at {TOKENIZERS_DIR} (set LOSSMASK_TOKENIZERS)")
    return TOKENIZERS_DIR


_CHAT_TOKENIZERS: dict = {}


def chat_tokenizer(family: str):
    """``lossmask.load_tokenizer`` of one family, loaded once per test session (big vocabularies load slowly).

    Shared between tests: do not modify it (load a fresh one with ``load_tokenizer(tokenizer_path(f))``)."""
    if family not in _CHAT_TOKENIZERS:
        from lossmask import load_tokenizer

        _CHAT_TOKENIZERS[family] = load_tokenizer(tokenizer_path(family))
    return _CHAT_TOKENIZERS[family]


_DETECTED: dict = {}


def detected_markers(family: str):
    """``(markers, report)`` of ``detect_markers_with_report`` on one family, once per test session
    (warnings silenced: Falcon's no-stop-token warning is tested on its own)."""
    if family not in _DETECTED:
        import warnings

        from lossmask.detect import detect_markers_with_report

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _DETECTED[family] = detect_markers_with_report(chat_tokenizer(family))
    return _DETECTED[family]
