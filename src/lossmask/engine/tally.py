"""A job's running totals, added up batch by batch: what the per-batch step hands to the report."""

from __future__ import annotations

from dataclasses import dataclass, field

from .outcomes import MAX_EXAMPLES, REJECTED_REASONS, OutcomeCounts


@dataclass
class Tally:
    """Running totals of a job, added up batch by batch (and across workers with ``+``).

    ``counts`` holds the engine's outcomes for the rows that were labelled; ``invalid`` the rows
    rejected before labelling, with up to ``MAX_EXAMPLES`` of their messages; ``rows_out`` the rows
    written (or returned).
    """

    counts: OutcomeCounts = field(default_factory=OutcomeCounts)
    invalid: int = 0
    invalid_examples: list[str] = field(default_factory=list)
    rows_out: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    dropped_example: tuple[list[int], list[int]] | None = None  # (token ids, labels) of one row that trains nothing
    # rows rendered but not labelled, by reason (content_dropped, special_tokens_in_content), with examples
    rejected: dict[str, int] = field(default_factory=lambda: {reason: 0 for reason in REJECTED_REASONS})
    rejected_examples: list[str] = field(default_factory=list)
    # rows whose message text held a special-token string (whatever special_tokens_in_content did)
    special_rows: int = 0
    special_example: str | None = None
    tokens_dropped: int = 0  # tokens of the rows that train nothing
    drop_causes: dict[str, int] = field(default_factory=dict)  # dropped rows by what they show (outcomes.CAUSES)
    drop_examples: dict[str, tuple[int, list[int], list[int]]] = field(default_factory=dict)  # cause -> (row, ids, labels)
    shapes: dict[str, int] = field(default_factory=dict)  # rows the conversation-shape policy changed, per shape
    media_tokens: int = 0  # image tokens of the rows labelled (placeholders, expansions, begin/end): never trained
    # rows whose marker labels broke the role invariant, labelled from the rendering instead (outcomes.LABELLED_FROM_RENDERING)
    from_rendering: int = 0
    from_rendering_example: str | None = None
    # where weights were computed: role -> [trained tokens, weight mass]; source value -> [rows, trained tokens, mass]
    weights_by_role: dict[str, list] = field(default_factory=dict)
    weights_by_source: dict[str, list] = field(default_factory=dict)

    def __add__(self, other: "Tally") -> "Tally":
        seconds = dict(self.seconds)
        for stage, value in other.seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
        return Tally(
            counts=self.counts + other.counts,
            invalid=self.invalid + other.invalid,
            invalid_examples=(self.invalid_examples + other.invalid_examples)[:MAX_EXAMPLES],
            rows_out=self.rows_out + other.rows_out,
            seconds=seconds,
            dropped_example=self.dropped_example or other.dropped_example,
            rejected={k: self.rejected.get(k, 0) + other.rejected.get(k, 0) for k in self.rejected | other.rejected},
            rejected_examples=(self.rejected_examples + other.rejected_examples)[:MAX_EXAMPLES],
            special_rows=self.special_rows + other.special_rows,
            special_example=self.special_example or other.special_example,
            tokens_dropped=self.tokens_dropped + other.tokens_dropped,
            drop_causes={c: self.drop_causes.get(c, 0) + other.drop_causes.get(c, 0)
                         for c in self.drop_causes | other.drop_causes},
            drop_examples={**other.drop_examples, **self.drop_examples},
            shapes={k: self.shapes.get(k, 0) + other.shapes.get(k, 0) for k in self.shapes | other.shapes},
            media_tokens=self.media_tokens + other.media_tokens,
            from_rendering=self.from_rendering + other.from_rendering,
            from_rendering_example=self.from_rendering_example or other.from_rendering_example,
            weights_by_role=_add_lists(self.weights_by_role, other.weights_by_role),
            weights_by_source=_add_lists(self.weights_by_source, other.weights_by_source),
        )

    def __iadd__(self, other: "Tally") -> "Tally":
        """``other`` added into this tally, in place (the job's tally is shared with its progress bar)."""
        self.__dict__.update((self + other).__dict__)
        return self

    def add_weights(self, by_role: dict[str, list], by_source: dict[str, list] | None) -> None:
        """Trained tokens and weight mass of one batch, per role and per value of the source column."""
        self.weights_by_role = _add_lists(self.weights_by_role, by_role)
        if by_source:
            self.weights_by_source = _add_lists(self.weights_by_source, by_source)

    def add_invalid(self, row: int, message: str) -> None:
        self.invalid += 1
        if len(self.invalid_examples) < MAX_EXAMPLES:
            self.invalid_examples.append(f"row {row}: {message}")

    def add_rejected(self, row: int, reason: str, message: str) -> None:
        """A row rendered but never labelled (``content_dropped``, ``special_tokens_in_content``)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if len(self.rejected_examples) < MAX_EXAMPLES:
            self.rejected_examples.append(f"{reason}: row {row}: {message}")

    def add_from_rendering(self, row: int, message: str) -> None:
        """A row the markers could not tell apart, labelled from the rendering (kept, counted apart)."""
        self.from_rendering += 1
        self.from_rendering_example = self.from_rendering_example or f"row {row}: {message}"

    def add_shapes(self, shapes: dict[str, int]) -> None:
        for shape, rows in shapes.items():
            self.shapes[shape] = self.shapes.get(shape, 0) + rows

    def add_special(self, rows: int, example: str | None) -> None:
        self.special_rows += rows
        self.special_example = self.special_example or example

    def time(self, stage: str, seconds: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @property
    def rows_in(self) -> int:
        return self.counts.rows + self.invalid + sum(self.rejected.values())

    def to_dict(self) -> dict:
        """A plain-data form, for sending across processes (Ray workers)."""
        return {
            "counts": {"rows": self.counts.rows, "tokens": self.counts.tokens,
                       "tokens_trained": self.counts.tokens_trained, "by_outcome": dict(self.counts.by_outcome)},
            "invalid": self.invalid,
            "invalid_examples": list(self.invalid_examples),
            "rows_out": self.rows_out,
            "seconds": dict(self.seconds),
            "dropped_example": self.dropped_example,
            "rejected": dict(self.rejected),
            "rejected_examples": list(self.rejected_examples),
            "special_rows": self.special_rows,
            "special_example": self.special_example,
            "tokens_dropped": self.tokens_dropped,
            "drop_causes": dict(self.drop_causes),
            "drop_examples": {c: list(e) for c, e in self.drop_examples.items()},
            "shapes": dict(self.shapes),
            "from_rendering": self.from_rendering,
            "from_rendering_example": self.from_rendering_example,
            "weights_by_role": {k: list(v) for k, v in self.weights_by_role.items()},
            "weights_by_source": {k: list(v) for k, v in self.weights_by_source.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Tally":
        return cls(
            counts=OutcomeCounts(**data["counts"]),
            invalid=data["invalid"],
            invalid_examples=list(data["invalid_examples"]),
            rows_out=data["rows_out"],
            seconds=dict(data["seconds"]),
            dropped_example=data.get("dropped_example"),
            rejected=dict(data.get("rejected") or {reason: 0 for reason in REJECTED_REASONS}),
            rejected_examples=list(data.get("rejected_examples") or []),
            special_rows=int(data.get("special_rows") or 0),
            special_example=data.get("special_example"),
            tokens_dropped=data.get("tokens_dropped", 0),
            drop_causes=dict(data.get("drop_causes", {})),
            drop_examples={c: tuple(e) for c, e in data.get("drop_examples", {}).items()},
            shapes=dict(data.get("shapes", {})),
            from_rendering=int(data.get("from_rendering") or 0),
            from_rendering_example=data.get("from_rendering_example"),
            weights_by_role={k: list(v) for k, v in data.get("weights_by_role", {}).items()},
            weights_by_source={k: list(v) for k, v in data.get("weights_by_source", {}).items()},
        )


def _add_lists(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    """Two ``{key: [numbers...]}`` tallies added key by key and place by place."""
    out = {k: list(v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = [x + y for x, y in zip(out[k], v)] if k in out else list(v)
    return out
