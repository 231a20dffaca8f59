"""The bundled example: a few ChatML-like rows, labelled, with trained tokens highlighted.

It needs no tokenizer: the rows are written with a tiny word-level vocabulary so that the output
reads as text. ``lossmask example`` prints it.
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa

from .engine.labels import label_batch
from .engine.patterns import Markers
from .jobs.display import render_tokens

IM_START, IM_END, NL = "<|im_start|>", "<|im_end|>", "\\n"

SAMPLE_ROWS = [
    # a two-turn chat with a system prompt: both assistant turns train, through <|im_end|>
    f"{IM_START} system {NL} Be brief. {IM_END} {NL} {IM_START} user {NL} Capital of France? {IM_END} {NL} "
    f"{IM_START} assistant {NL} Paris. {IM_END} {NL} {IM_START} user {NL} And Spain? {IM_END} {NL} "
    f"{IM_START} assistant {NL} Madrid. {IM_END} {NL}",
    # a tool call and its result: the call trains, the tool's answer does not
    f"{IM_START} user {NL} Weather in Oslo? {IM_END} {NL} {IM_START} assistant {NL} <tool_call> get_weather(Oslo) "
    f"</tool_call> {IM_END} {NL} {IM_START} tool {NL} -3C, snow {IM_END} {NL} {IM_START} assistant {NL} "
    f"Cold: -3C and snowing. {IM_END} {NL}",
    # truncated right after the assistant header: nothing to train
    f"{IM_START} user {NL} Write a long essay. {IM_END} {NL} {IM_START} assistant {NL}",
    # no assistant turn at all
    f"{IM_START} user {NL} Hello? {IM_END} {NL}",
]


def build_sample() -> tuple[pa.Array, Markers, list[str]]:
    """The sample rows as token ids, the ChatML markers, and the vocabulary (id -> text)."""
    vocab: dict[str, int] = {}
    rows = [[vocab.setdefault(word, len(vocab)) for word in row.split()] for row in SAMPLE_ROWS]
    ids = lambda text: [vocab[word] for word in text.split()]  # noqa: E731
    markers = Markers(
        response=[ids(f"{IM_START} assistant {NL}")],
        instruction=[ids(IM_START)],  # any other turn (system, user, tool) closes the span
        end=[ids(IM_END)],  # the stop token is trained
    )
    return pa.array(rows, type=pa.list_(pa.int32())), markers, list(vocab)


def render_row(row: np.ndarray, labels: np.ndarray, vocab: list[str], *, colour: bool) -> str:
    return render_tokens([vocab[t] for t in row.tolist()], (labels != -100).tolist(), colour=colour)


def run_example(out=None) -> int:
    out = out or sys.stdout
    colour = out.isatty()
    input_ids, markers, vocab = build_sample()
    result = label_batch(input_ids, markers)
    legend = "trained tokens are highlighted" if colour else "trained tokens are in [brackets]"
    print(f"lossmask example: {len(input_ids)} ChatML-like rows, markers {markers}; {legend}\n", file=out)
    for r in range(len(input_ids)):
        row = input_ids[r].values.to_numpy()
        labels = result.labels[r].values.to_numpy()
        outcome = result.outcomes[r]
        print(f"row {r} ({_OUTCOME_TEXT[outcome]}, {result.trained_tokens[r]} of {len(row)} tokens trained):", file=out)
        print("  " + render_row(row, labels, vocab, colour=colour) + "\n", file=out)
    counts = result.counts
    print(
        f"rows: {counts.rows}, trained: {counts.rows_trained}, dropped: {counts.rows_dropped} {counts.dropped}; "
        f"tokens trained: {counts.tokens_trained} of {counts.tokens}",
        file=out,
    )
    return 0


_OUTCOME_TEXT = {0: "trained", 1: "no_response: no assistant turn", 2: "empty_response: truncated after the header", 3: "empty"}
