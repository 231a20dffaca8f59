"""Fields that other trainers write keep those trainers' meaning (docs/weights.md, "Differences from the peers").

Each expectation is written out by hand from the peer's documented behaviour, not from running the peer:

- axolotl's ``chat_template`` strategy: with ``train_detail`` on a message, only the spans marked ``train: true``
  train (characters no span covers do not); a message's ``training`` flag decides whether anything in it trains,
  spans included; ``train_on_eos`` is ``turn`` (the stop token of each trained turn), ``last`` (the last stop
  token of the conversation), ``all`` (the stop token after every turn) or ``none``;
- ms-swift's messages: ``loss`` switches a message's loss on or off and ``loss_scale`` sets its weight.
"""

from __future__ import annotations

import pytest

from test_weights import STOP, label, weighted_text

FAMILIES = ("chatml", "llama-3.1", "mistral-v3")


def turns(*texts, fields=None):
    """user/assistant messages from texts; ``fields``: {index of a message: the fields it adds}."""
    messages = [{"role": "user" if k % 2 == 0 else "assistant", "content": text} for k, text in enumerate(texts)]
    for k, extra in (fields or {}).items():
        messages[k].update(extra)
    return messages


# -- axolotl: train_detail ------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_axolotl_span_trains_only_its_characters(family):
    # "Alpha beta gamma." with one span over characters 0..4: axolotl trains "Alpha" (and the turn's stop token)
    span = [{"begin_offset": 0, "end_offset": 4, "train": True}]
    out, _ = label(family, [turns("Hi there", "Alpha beta gamma.", fields={1: {"train_detail": span}})])
    assert weighted_text(family, out) == [("Alpha", 1.0), (STOP[family], 1.0)]


def test_axolotl_span_in_the_middle_leaves_both_sides_untrained():
    span = [{"begin_offset": 5, "end_offset": 9, "train": True}]  # " beta", the token's space included
    out, _ = label("chatml", [turns("Hi there", "Alpha beta gamma.", fields={1: {"train_detail": span}})])
    assert weighted_text("chatml", out) == [("beta", 1.0), ("<|im_end|>", 1.0)]
    # "beta" alone: the token " beta" straddles the span's edge, and takes the lower weight (axolotl trains it:
    # a difference docs/weights.md lists)
    span = [{"begin_offset": 6, "end_offset": 9, "train": True}]
    out, _ = label("chatml", [turns("Hi there", "Alpha beta gamma.", fields={1: {"train_detail": span}})])
    assert weighted_text("chatml", out) == [("<|im_end|>", 1.0)]


@pytest.mark.parametrize("family", FAMILIES)
def test_axolotl_training_false_wins_over_a_train_true_span(family):
    span = [{"begin_offset": 0, "end_offset": 4, "train": True}]
    rows = [turns("Hi there", "Alpha beta gamma.", "And then?", "Second answer",
                  fields={1: {"training": False, "train_detail": span}})]
    out, _ = label(family, rows)
    assert weighted_text(family, out) == [("Second answer" + STOP[family], 1.0)]


def test_a_span_in_a_user_message_never_trains_it():
    span = [{"begin_offset": 0, "end_offset": 1, "train": True}]
    out, _ = label("chatml", [turns("Hi there", "Answer", fields={0: {"train_detail": span}})])
    assert weighted_text("chatml", out) == [("Answer<|im_end|>", 1.0)]


# -- axolotl: train_on_eos --------------------------------------------------------------------------------------

def test_axolotl_train_on_eos_all_trains_the_stop_token_after_an_untrained_turn():
    rows = [turns("Hi there", "First answer", "And then?", "Second answer", fields={1: {"training": False}})]
    out, _ = label("chatml", rows, train_on_eos="all")
    # the stop token after every turn: both user turns, the untrained first answer, and the trained second answer
    assert weighted_text("chatml", out) == [("<|im_end|>", 1.0)] * 3 + [("Second answer<|im_end|>", 1.0)]


def test_axolotl_train_on_eos_last_trains_the_last_stop_token_even_of_an_untrained_turn():
    rows = [turns("Hi there", "First answer", "And then?", "Second answer", fields={3: {"training": False}})]
    out, _ = label("chatml", rows, train_on_eos="last")
    assert weighted_text("chatml", out) == [("First answer", 1.0), ("<|im_end|>", 1.0)]


def test_axolotl_train_on_eos_turn_leaves_an_untrained_turns_stop_token():
    rows = [turns("Hi there", "First answer", "And then?", "Second answer", fields={1: {"training": False}})]
    out, _ = label("chatml", rows, train_on_eos="turn")
    assert weighted_text("chatml", out) == [("Second answer<|im_end|>", 1.0)]


# -- ms-swift: loss and loss_scale ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_ms_swift_loss_switches_on_and_loss_scale_weighs(family):
    rows = [turns("Hi there", "Alpha beta", "And then?", "Second answer", fields={1: {"loss": True, "loss_scale": 0.5}})]
    out, _ = label(family, rows)
    assert weighted_text(family, out) == [("Alpha beta" + STOP[family], 0.5), ("Second answer" + STOP[family], 1.0)]


def test_ms_swift_loss_false_switches_off_whatever_the_scale():
    rows = [turns("Hi there", "Alpha beta", "And then?", "Second answer", fields={1: {"loss": False, "loss_scale": 2.0}})]
    out, _ = label("chatml", rows)
    assert weighted_text("chatml", out) == [("Second answer<|im_end|>", 1.0)]


def test_ms_swift_stop_token_takes_its_turns_weight_here():
    # docs/weights.md, ms-swift: ms-swift weighs the stop token 1 whatever loss_scale says, and trains the last one
    # after loss: false; lossmask gives it the turn's weight, and train_on_eos="last" trains that last one at 1
    out, _ = label("chatml", [turns("Hi there", "Hi", fields={1: {"loss_scale": 0.5}})])
    assert weighted_text("chatml", out) == [("Hi<|im_end|>", 0.5)]
    rows = [turns("Hi there", "A", "And then?", "B", fields={3: {"loss": False}})]
    out, _ = label("chatml", rows)
    assert weighted_text("chatml", out) == [("A<|im_end|>", 1.0)]
    out, _ = label("chatml", rows, train_on_eos="last")
    assert weighted_text("chatml", out) == [("A", 1.0), ("<|im_end|>", 1.0)]


def test_a_boolean_field_alone_still_trains_at_one():
    rows = [turns("Hi there", "Alpha beta", "And then?", "Second answer", fields={1: {"loss": True}})]
    out, _ = label("chatml", rows, weights_by_role={"assistant": 0.5})
    assert weighted_text("chatml", out) == [("Alpha beta<|im_end|>", 1.0), ("Second answer<|im_end|>", 0.5)]
