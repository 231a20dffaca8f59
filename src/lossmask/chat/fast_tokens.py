"""The exact fast tokeniser: ``fastokens`` where it supports a tokenizer, proven against ``tokenizers`` per job.

``fastokens`` (``pip install 'lossmask[fast]'``) is a Rust tokeniser that loads the same
``tokenizer.json`` as Hugging Face ``tokenizers`` and gives the same ids, many times faster on the
byte-level BPE vocabularies (Qwen, Llama-3, gpt-oss, DeepSeek...). It refuses some pre-tokenizers
(``Metaspace``: Mistral v3 and other SentencePiece-style files; ``Punctuation``: Falcon): there lossmask says
so once and encodes with ``tokenizers``.

Trust is not assumed: the first texts a job encodes (``PROOF_CHARS`` characters of them, at least one
text) are also encoded with ``tokenizers``; any difference switches that tokenizer back to ``tokenizers``
for the rest of the process, with a warning naming the first text and token that differ.

``fastokens`` is imported here and nowhere else. ``LOSSMASK_FAST_TOKENIZER=0`` turns the fast path off.
Its load (a few seconds for a large vocabulary) runs on a thread, started by ``FastTokens.start`` as soon
as a job knows it will encode, so it overlaps marker resolution and rendering.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Callable, Sequence

import numpy as np

ENV_SWITCH = "LOSSMASK_FAST_TOKENIZER"
PROOF_CHARS = 100_000  # characters of the first batch also encoded with `tokenizers` (~25k tokens, ~0.04 s there)

WAIT_CHARS = 4_000_000  # a batch this large waits for the fast tokeniser to load (~2 s of `tokenizers` work)
Flat = tuple[np.ndarray, np.ndarray]  # (int32 ids, int64 row offsets)


class FastTokenizerWarning(UserWarning):
    """The fast tokeniser is not used for a tokenizer (unsupported, or it disagreed with ``tokenizers``)."""


def enabled() -> bool:
    """False when ``LOSSMASK_FAST_TOKENIZER`` is ``0``/``false``/``off``, or ``fastokens`` is not installed."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    try:
        import importlib.util

        return importlib.util.find_spec("fastokens") is not None
    except (ImportError, ValueError):  # pragma: no cover - broken installs
        return False


class FastTokens:
    """The fast encoder of one ``ChatTokenizer``: loading (on a thread), ready, or not usable.

    ``encode(texts)`` returns ``(ids, offsets)`` or ``None`` when the fast path is not usable (the caller
    then encodes with ``tokenizers``). ``begin_job()`` makes the next ``encode`` prove itself again.
    """

    def __init__(self, chat_tokenizer: Any, name: str):
        self.chat_tokenizer = chat_tokenizer
        self.name = name
        self.proven = False
        self.reason: str | None = None  # why the fast path is off, once known
        self.off = False
        self._tokenizer: Any = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start loading on a thread (no-op when started, or when the fast path is off)."""
        with self._lock:
            if self._thread is not None or self._tokenizer is not None or self.reason is not None:
                return
            if not enabled():  # not installed, or switched off: silently tokenizers
                self.off = True
                return
            # not a daemon: the interpreter waits for the load at exit (a daemon thread killed inside the Rust
            # loader aborts the process: "FATAL: exception not rethrown", seen after a small job)
            self._thread = threading.Thread(target=self._load, name="lossmask-fastokens-load", daemon=False)
            self._thread.start()

    def _load(self) -> None:
        try:
            import fastokens

            backend = self.chat_tokenizer.tokenizer.backend_tokenizer
            tokenizer = fastokens.Tokenizer.from_json_str(self.chat_tokenizer.tokenizer_json)
            tokenizer.no_truncation()
            tokenizer.no_padding()
            self._split_special = bool(getattr(backend, "encode_special_tokens", False))
            self._tokenizer = tokenizer
        except Exception as exc:  # unsupported pre-tokenizer / normalizer / model, or a broken install
            self.reason = f"fastokens cannot load it ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"

    def ready(self) -> Any:
        """The loaded ``fastokens.Tokenizer``, waiting for the load; None (said once) when not usable."""
        self.start()
        thread = self._thread
        if thread is not None:
            thread.join()
        if self._tokenizer is None and self.reason is not None:
            self._say()
        return self._tokenizer

    def _say(self) -> None:
        """One warning per tokenizer saying why ``tokenizers`` encodes it."""
        if not getattr(self, "_said", False):
            self._said = True
            warnings.warn(f"lossmask: {self.name}: {self.reason}; encoding with tokenizers", FastTokenizerWarning,
                          stacklevel=5)

    def begin_job(self) -> None:
        self.proven = False

    def encode(self, texts: Sequence[str], reference: Callable[[Sequence[str]], Flat]) -> Flat | None:
        """Fast ids of ``texts``; the first call of a job also encodes a prefix with ``reference`` and compares.

        While the fast tokeniser is still loading, a batch of fewer than ``WAIT_CHARS`` characters is left to
        ``tokenizers`` (None) rather than waiting for the load: a small job never waits seconds for it.
        """
        self.start()
        thread = self._thread
        if thread is not None and thread.is_alive() and sum(len(t) for t in texts) < WAIT_CHARS:
            return None
        tokenizer = self.ready()
        if tokenizer is None:
            return None
        raw_ids, raw_offsets = tokenizer.encode_batch_flat(
            list(texts), add_special_tokens=False, split_special_tokens=self._split_special
        )
        ids = np.frombuffer(raw_ids, dtype=np.int32)  # uint32 ids below 2**31: the same bytes
        offsets = np.frombuffer(raw_offsets, dtype=np.int64)
        if not self.proven and len(texts):
            if not self._prove(texts, ids, offsets, reference):
                self._say()
                return None
            self.proven = True
        return ids, offsets

    def _prove(self, texts: Sequence[str], ids: np.ndarray, offsets: np.ndarray, reference) -> bool:
        chars = np.cumsum([len(t) for t in texts[:4096]])
        n = max(1, int(np.searchsorted(chars, PROOF_CHARS)))
        ref_ids, ref_offsets = reference(texts[:n])
        if np.array_equal(ref_offsets, offsets[: n + 1]) and np.array_equal(ref_ids, ids[: offsets[n]]):
            return True
        row = first_difference(ref_ids, ref_offsets, ids, offsets, n)
        start, stop = int(offsets[row]), int(offsets[row + 1])
        ref = ref_ids[ref_offsets[row] : ref_offsets[row + 1]]
        ours = ids[start:stop]
        at = int(np.argmax(ref[: len(ours)] != ours[: len(ref)])) if min(len(ref), len(ours)) and \
            not np.array_equal(ref[: len(ours)], ours[: len(ref)]) else min(len(ref), len(ours))
        self.reason = (f"fastokens and tokenizers differ on text {row} of the first batch at token {at} "
                       f"(tokenizers {ref[at:at + 3].tolist()}, fastokens {ours[at:at + 3].tolist()}); "
                       "the job goes on with tokenizers")
        self._tokenizer = None
        self.proven = False
        return False

    # spawned worker processes get a fresh, unloaded encoder
    def __getstate__(self) -> dict:
        return {"chat_tokenizer": self.chat_tokenizer, "name": self.name, "reason": self.reason}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["chat_tokenizer"], state["name"])
        self.reason = state["reason"]
        self._said = state["reason"] is not None  # the parent said it already


def first_difference(ref_ids: np.ndarray, ref_offsets: np.ndarray, ids: np.ndarray, offsets: np.ndarray, n: int) -> int:
    """The first of ``n`` rows whose ids differ between two flat encodings."""
    for row in range(n):
        a = ref_ids[ref_offsets[row] : ref_offsets[row + 1]]
        b = ids[offsets[row] : offsets[row + 1]]
        if not np.array_equal(a, b):
            return row
    return n - 1  # pragma: no cover - called only when some row differs
