"""What a row ends as, and the counts a batch or a whole job reports (SPEC.md, "What a row can end as")."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Outcome(enum.IntEnum):
    """Per-row outcome codes, as the kernels write them."""

    TRAINED = 0  # at least one label is not ignore_index
    NO_RESPONSE = 1  # no response pattern occurs in the row
    EMPTY_RESPONSE = 2  # response patterns occur but every span is empty (e.g. truncated after the header)
    EMPTY = 3  # the row has no tokens (null rows count here too)

    @property
    def reason(self) -> str:
        return self.name.lower()


DROP_REASONS = tuple(o.reason for o in Outcome if o is not Outcome.TRAINED)


@dataclass
class OutcomeCounts:
    """Row outcomes and token totals, added up over batches (and across workers with ``+``)."""

    rows: int = 0
    tokens: int = 0
    tokens_trained: int = 0
    by_outcome: dict[str, int] = field(default_factory=lambda: {o.reason: 0 for o in Outcome})

    @classmethod
    def from_rows(cls, outcomes: np.ndarray, trained_tokens: np.ndarray, row_lengths: np.ndarray) -> "OutcomeCounts":
        counts = np.bincount(outcomes.astype(np.intp, copy=False), minlength=len(Outcome))
        return cls(
            rows=int(outcomes.shape[0]),
            tokens=int(row_lengths.sum()),
            tokens_trained=int(trained_tokens.sum()),
            by_outcome={o.reason: int(counts[o]) for o in Outcome},
        )

    def __add__(self, other: "OutcomeCounts") -> "OutcomeCounts":
        return OutcomeCounts(
            rows=self.rows + other.rows,
            tokens=self.tokens + other.tokens,
            tokens_trained=self.tokens_trained + other.tokens_trained,
            by_outcome={k: self.by_outcome.get(k, 0) + other.by_outcome.get(k, 0) for k in self.by_outcome | other.by_outcome},
        )

    @property
    def dropped(self) -> dict[str, int]:
        """Rows that end with nothing trained, by reason."""
        return {reason: self.by_outcome.get(reason, 0) for reason in DROP_REASONS}

    @property
    def rows_dropped(self) -> int:
        return sum(self.dropped.values())

    @property
    def rows_trained(self) -> int:
        return self.by_outcome.get(Outcome.TRAINED.reason, 0)

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "rows_trained": self.rows_trained,
            "dropped": self.dropped,
            "tokens": self.tokens,
            "tokens_trained": self.tokens_trained,
        }
