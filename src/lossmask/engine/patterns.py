"""`Markers`: the four sets of token-id patterns of SPEC.md, and their compiled form for kernels."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from .automaton import Automaton, choose_anchors

KINDS = ("response", "instruction", "end", "mask_out")

# Kind codes as the kernels see them.
RESPONSE, INSTRUCTION, END, MASK_OUT = range(4)

Pattern = tuple[int, ...]

# Tokens of a batch counted, spread over it, to choose the automaton's anchors (``CompiledMarkers.automaton_for``).
ANCHOR_SAMPLE = 1 << 16

# The largest id a pattern may hold: kernels compare ids as int64.
MAX_ID = (1 << 63) - 1


def _as_patterns(kind: str, patterns: Iterable[Sequence[int]]) -> tuple[Pattern, ...]:
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
        raise TypeError(
            f"Markers.{kind} must be a list of token-id sequences such as [[151644, 77091, 198]], "
            f"got {type(patterns).__name__}"
        )
    out: list[Pattern] = []
    for index, pattern in enumerate(patterns):
        if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Iterable):
            raise TypeError(
                f"Markers.{kind}[{index}] must be a sequence of token ids, got {pattern!r}; "
                "wrap a single pattern in a list: [[id, id, ...]]"
            )
        ids = tuple(pattern)
        if not ids:
            raise ValueError(f"Markers.{kind}[{index}] is an empty pattern; every pattern needs at least one token")
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise TypeError(f"Markers.{kind}[{index}] holds {token!r}; token ids must be integers")
            if token < 0:
                raise ValueError(f"Markers.{kind}[{index}] holds the negative id {token}; token ids are >= 0")
            if token > MAX_ID:
                raise ValueError(
                    f"Markers.{kind}[{index}] holds the id {token}, beyond what a token id can be (int64, at most "
                    f"{MAX_ID}); marker ids are indices into the tokenizer's vocabulary: pass the ids "
                    "tokenizer.convert_tokens_to_ids gives, or derive them with lossmask.detect_markers"
                )
        normalised = tuple(int(token) for token in ids)
        if normalised not in out:  # a variant listed twice is one variant
            out.append(normalised)
    return tuple(out)


@dataclass(frozen=True)
class Markers:
    """Token-id patterns that decide which tokens are trained (see SPEC.md).

    - ``response``: opens a trained span; the pattern itself is not trained.
    - ``instruction``: closes a span before it; not trained.
    - ``end``: closes a span after it; the pattern itself is trained (the stop token).
    - ``mask_out``: never trained, even inside a span.

    Several variants of one marker (the same text tokenised differently in context) are simply
    several patterns in the same set.
    """

    response: tuple[Pattern, ...]
    instruction: tuple[Pattern, ...] = ()
    end: tuple[Pattern, ...] = ()
    mask_out: tuple[Pattern, ...] = ()
    _compiled: "CompiledMarkers | None" = field(default=None, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        for kind in KINDS:
            object.__setattr__(self, kind, _as_patterns(kind, getattr(self, kind)))
        if not self.response:
            raise ValueError(
                "Markers need at least one response pattern (the token ids that open an assistant turn, "
                "e.g. [[151644, 77091, 198]] for '<|im_start|>assistant\\n'); "
                "use lossmask.detect_markers(tokenizer) to derive them from a chat template"
            )

    def __repr__(self) -> str:
        parts = [f"{kind}={list(map(list, getattr(self, kind)))}" for kind in KINDS if getattr(self, kind)]
        return f"Markers({', '.join(parts)})"

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, list[list[int]]]:
        return {kind: [list(p) for p in getattr(self, kind)] for kind in KINDS}

    def to_json(self, path: str | os.PathLike | None = None, *, indent: int | None = None) -> str:
        """Return the markers as JSON; also write them to ``path`` when one is given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "Markers":
        if not isinstance(data, dict):
            raise TypeError(f"Markers JSON must be an object with the keys {list(KINDS)}, got {type(data).__name__}")
        unknown = set(data) - set(KINDS)
        if unknown:
            raise ValueError(f"Markers JSON has unknown keys {sorted(unknown)}; expected some of {list(KINDS)}")
        return cls(**{kind: data.get(kind, ()) for kind in KINDS})

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "Markers":
        """Load markers from a JSON string or from the path of a JSON file."""
        text = str(source)
        if not text.lstrip().startswith("{"):
            with open(source, encoding="utf-8") as fh:
                text = fh.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"Markers JSON is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    # -- kernel form --------------------------------------------------------------------------

    def compiled(self) -> "CompiledMarkers":
        """The flat-buffer form that every kernel reads; built once per Markers value."""
        if self._compiled is None:
            object.__setattr__(self, "_compiled", CompiledMarkers.build(self))
        return self._compiled  # type: ignore[return-value]


@dataclass(frozen=True, eq=False)
class CompiledMarkers:
    """Patterns as flat arrays: ``tokens[offsets[k]:offsets[k+1]]`` is pattern ``k`` of kind ``kinds[k]``
    (what the torch and MLX kernels read), and the ``automaton`` the numba kernel runs (``automaton.py``),
    built on first use.
    """

    tokens: np.ndarray  # int64, all patterns concatenated
    offsets: np.ndarray  # int64, len = n_patterns + 1
    kinds: np.ndarray  # int8 kind codes

    @cached_property
    def patterns(self) -> list[list[int]]:
        """Each pattern's token ids, in order."""
        return [self.tokens[self.offsets[k] : self.offsets[k + 1]].tolist() for k in range(self.kinds.shape[0])]

    @cached_property
    def max_length(self) -> int:
        return int(np.diff(self.offsets).max())

    # The automata built, by their anchors; and [sample size, anchors] of the last choice on data.
    _automata: dict = field(default_factory=dict, repr=False)
    _chosen: list = field(default_factory=lambda: [0, None], repr=False)

    @cached_property
    def automaton(self) -> Automaton:
        """The automaton anchored on each pattern's first token: the one used when no data is at hand."""
        return self.anchored(None)

    def anchored(self, anchors: tuple[int, ...] | None) -> Automaton:
        """The automaton with these anchor offsets (one per pattern; see ``automaton.py``), built once."""
        built = self._automata.get(anchors)
        if built is None:
            built = Automaton.build(list(zip(self.kinds.tolist(), self.patterns)), response=RESPONSE,
                                    instruction=INSTRUCTION, end=END, mask_out=MASK_OUT, anchors=anchors)
            self._automata[anchors] = built
        return built

    def automaton_for(self, values: np.ndarray) -> Automaton:
        """The automaton anchored where ``values`` make the engine stop least often
        (``automaton.choose_anchors``), counted on ``ANCHOR_SAMPLE`` tokens spread evenly over them (a
        batch may begin unlike the rest: with one long system prompt, say). Chosen once per marker set,
        and again only when a later batch gives a larger sample: the labels never depend on it, only
        the engine's speed."""
        size = min(int(values.shape[0]), ANCHOR_SAMPLE)
        if size > self._chosen[0]:
            a = self.automaton
            sample = values[:: max(1, values.shape[0] // ANCHOR_SAMPLE)][:size]
            by_class = np.bincount(a.class_of(sample), minlength=a.n_classes)
            counts = dict(zip(self.tokens.tolist(), by_class[a.class_of(self.tokens)].tolist()))
            anchors = choose_anchors(self.patterns, counts)
            self._chosen[:] = [size, anchors if any(anchors) else None]  # None: the first tokens, already built
        return self.anchored(self._chosen[1])

    @classmethod
    def build(cls, markers: Markers) -> "CompiledMarkers":
        patterns = [(code, p) for code, kind in enumerate(KINDS) for p in getattr(markers, kind)]
        lengths = np.array([len(p) for _, p in patterns], dtype=np.int64)
        offsets = np.zeros(len(patterns) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for _, p in patterns for t in p), dtype=np.int64, count=int(offsets[-1]))
        kinds = np.array([code for code, _ in patterns], dtype=np.int8)
        return cls(tokens=tokens, offsets=offsets, kinds=kinds)
