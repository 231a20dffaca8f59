"""benchmarks/dropped_rows.py: the record schema, and lossmask's detected markers drop and mislabel nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "dropped_rows.py"
FAMILIES = ("qwen3", "glm-4")  # tools and reasoning; no end-of-turn token of its own (the next role stops)
KEYS = {"family", "source", "max_length", "rows", "dropped", "rows_wrong", "tokens_wrongly_trained",
        "tokens_wrongly_masked", "stop_token_trained", "seconds"}


dropped_rows = load_script(SCRIPT)


def test_standalone_collator_rule():
    """Masked from the row start and from each instruction to the end of the next response; a row without one is ignored."""
    markers = dropped_rows.Standalone(response=(7, 8), instruction=(5,), how="test")
    rows = [np.array([1, 5, 2, 7, 8, 3, 4, 5, 2, 7, 8, 6]), np.array([1, 5, 2, 3]), np.array([], dtype=np.int64)]
    trained, outcomes = dropped_rows.label_standalone(rows, markers)
    assert trained[0].tolist() == [False] * 5 + [True, True] + [False] * 4 + [True]
    assert not trained[1].any() and outcomes.tolist() == [0, 1, 3]
    _, outcomes = dropped_rows.label_standalone([np.array([1, 7, 8, 2])], markers)
    assert outcomes.tolist() == [4]  # the response occurs, the instruction never does: ignored all the same
    everything, _ = dropped_rows.label_standalone(rows[:1], None)  # no markers: the full sequence trains
    assert everything[0].all()


def test_synthetic_chats_are_seeded_and_varied():
    a, b = dropped_rows.synthetic_chats(40, seed=3), dropped_rows.synthetic_chats(40, seed=3)
    assert a == b
    roles = {m["role"] for row in a for m in row["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    assert len({len(row["messages"]) for row in a}) > 3
    plain = dropped_rows.synthetic_chats(40, seed=3, system=False, tools=False)
    assert {m["role"] for row in plain for m in row["messages"]} == {"user", "assistant"}


def test_benchmark_on_a_few_families(tokenizers_dir, tmp_path):
    missing = [f for f in FAMILIES if not (tokenizers_dir / f).is_dir()]
    if missing:
        pytest.skip(f"tokenizers {missing} not in {tokenizers_dir}")
    code = dropped_rows.main(["--tokenizers", str(tokenizers_dir), "--out", str(tmp_path), "--rows", "12",
                              "--max-lengths", "128,512", "--families", *FAMILIES])
    assert code == 0
    records = json.loads((tmp_path / "dropped_rows.json").read_text(encoding="utf-8"))
    assert (tmp_path / "dropped_rows.md").read_text(encoding="utf-8").startswith("# Dropped rows")
    assert (tmp_path / "dropped_rows.png").read_bytes()[:4] == b"\x89PNG"
    assert len(records) == len(FAMILIES) * 3 * 3
    for r in records:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["family"] in FAMILIES and r["source"] in ("detected", "standalone", "table")
        assert r["max_length"] in (None, 128, 512)
        assert {"no_response", "empty_response", "empty"} <= set(r["dropped"]) <= {"no_response", "empty_response", "empty", "no_instruction"}
        assert all(isinstance(n, int) and n >= 0 for n in r["dropped"].values())
        assert 0 <= r["rows_wrong"] <= r["rows"] > 0
        assert r["stop_token_trained"] is None or 0 <= r["stop_token_trained"] <= 1
        assert r["seconds"] >= 0
    for r in records:
        if r["source"] != "detected":
            continue
        # detected: never a wrong token; the only drops are rows cut before any assistant token trains
        assert r["rows_wrong"] == r["tokens_wrongly_trained"] == r["tokens_wrongly_masked"] == 0, r
        assert r["dropped"]["no_response"] == r["dropped"]["empty"] == 0, r
        if r["max_length"] is None:
            assert r["dropped"]["empty_response"] == 0 and r["stop_token_trained"] == 1.0, r
    # truncation at 128 tokens cuts some rows before their first answer
    assert sum(r["dropped"]["empty_response"] for r in records if r["source"] == "detected" and r["max_length"] == 128) > 0
