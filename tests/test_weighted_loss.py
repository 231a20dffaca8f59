"""Per-token loss weights on the TRL / transformers side: the collator carries the rows' ``loss_weights``
(padding, padding-free packing, truncation, mixed batches), and the weighted loss (as
``compute_loss_func`` and as the mixin) equals a hand-computed weighted cross-entropy to 1e-6 on a
tiny model, per token and per sequence, up to real SFTTrainer steps."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import lossmask

torch = pytest.importorskip("torch")
from lossmask.collator import (  # noqa: E402
    CompletionCollator,
    WeightedLoss,
    WeightedLossMixin,
    share_of_accumulated_batch,
    weighted_cross_entropy,
)

from conftest import tokenizer_path  # noqa: E402
from test_collator import MARKERS, ROWS, _tiny_llama  # noqa: E402


def hand_weights(labels, *, prompt=0.1, seed=0):
    """Hand-chosen weights for a labelled row: trained tokens 0, 0.5, 1 or 2.5 (a few set to 0), the prompt ``prompt``."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed + len(labels))
    w = np.where(labels != -100, rng.choice([0.0, 0.5, 1.0, 2.5], size=len(labels), p=[0.2, 0.3, 0.3, 0.2]), prompt)
    return w.astype(np.float32)


def weighted_rows(rows=ROWS, markers=MARKERS, prompt=0.1):
    out = []
    for i, (row, labels) in enumerate(zip(rows, lossmask.make_labels(rows, markers))):
        w = hand_weights(labels, prompt=prompt, seed=i)
        out.append({"input_ids": list(row), "loss_weights": w.tolist(),
                    "labels": [t if x > 0 else -100 for t, x in zip(row, w)]})
    return out


def hand_loss(logits_rows, rows, weight_rows, *, per_sequence=False):
    """sum(w * nll) / sum(w) over next-token targets, row by row in float64 (no batch, no padding)."""
    totals, masses = [], []
    for logits, ids, w in zip(logits_rows, rows, weight_rows):
        logits = np.asarray(logits, dtype=np.float64)[: len(ids) - 1]
        if len(ids) < 2:
            continue
        top = logits.max(-1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
        nll = logz - logits[np.arange(len(ids) - 1), np.asarray(ids[1:])]
        w = np.asarray(w, dtype=np.float64)[1:]
        totals.append(float((w * nll).sum()))
        masses.append(float(w.sum()))
    if per_sequence:
        means = [t / m for t, m in zip(totals, masses) if m > 0]
        return sum(means) / len(means)
    return sum(totals) / sum(masses)


# -- the collator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
def test_weights_padded_with_zero_and_labels_follow_them(side):
    rows = weighted_rows()
    batch = CompletionCollator(markers=MARKERS, pad_token_id=5, padding_side=side)(rows)
    weights, labels, attn = batch["loss_weights"], batch["labels"], batch["attention_mask"].bool()
    assert weights.dtype == torch.float32 and weights.shape == batch["input_ids"].shape
    assert (weights[~attn] == 0).all()  # padding: weight 0
    for r, row in enumerate(rows):
        want = np.asarray(row["loss_weights"], dtype=np.float32)
        if len(want):
            want[0] = 0.0  # nothing predicts a sequence's first token
        got = weights[r][attn[r]].numpy()
        np.testing.assert_array_equal(got, want)
        # labels are the ids where the weight is > 0, even where the markers say otherwise
        ids = batch["input_ids"][r][attn[r]].numpy()
        np.testing.assert_array_equal(labels[r][attn[r]].numpy(), np.where(want > 0, ids, -100))


def test_padding_free_and_packed_rows_carry_weights():
    rows = weighted_rows()
    flat = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=True, pad_to_multiple_of=8)(rows)
    assert flat["loss_weights"].shape == flat["input_ids"].shape == (1, 48)  # 41 tokens, rounded up to 8
    want = np.concatenate([np.r_[0.0, np.asarray(r["loss_weights"][1:])] if r["input_ids"] else [] for r in rows])
    got = flat["loss_weights"][0].numpy()
    np.testing.assert_array_equal(got[: len(want)], want.astype(np.float32))
    assert (got[len(want):] == 0).all()
    # rows packed beforehand (seq_lengths): each packed sequence's first token has weight 0
    packed = {"input_ids": rows[0]["input_ids"] + rows[1]["input_ids"],
              "loss_weights": rows[0]["loss_weights"] + rows[1]["loss_weights"],
              "seq_lengths": [len(rows[0]["input_ids"]), len(rows[1]["input_ids"])]}
    other = {**rows[2], "seq_lengths": [len(rows[2]["input_ids"])]}
    for padding_free in (True, False):
        out = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=padding_free)([packed, other])
        w = out["loss_weights"][0].numpy()
        n0 = len(rows[0]["input_ids"])
        assert w[0] == 0 and w[n0] == 0
        np.testing.assert_array_equal(w[1:n0], np.asarray(rows[0]["loss_weights"][1:], np.float32))
        np.testing.assert_array_equal(w[n0 + 1: len(packed["input_ids"])], np.asarray(rows[1]["loss_weights"][1:], np.float32))


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncated_rows_cut_their_weights(mode):
    """TRL truncates input_ids and labels but leaves other columns whole: the weights are cut the same way."""
    rows = weighted_rows()[:2]
    cut = 7
    sl = slice(None, cut) if mode == "keep_start" else slice(-cut, None)
    truncated = [{"input_ids": r["input_ids"][sl], "labels": r["labels"][sl], "loss_weights": r["loss_weights"]} for r in rows]
    out = CompletionCollator(markers=MARKERS, pad_token_id=0, truncation_mode=mode)(truncated)
    for r, row in enumerate(rows):
        want = np.asarray(row["loss_weights"], np.float32)[sl].copy()
        want[0] = 0.0
        np.testing.assert_array_equal(out["loss_weights"][r, :cut].numpy(), want)
    # packed and then cut: seq_lengths and weights cut alike
    packed = {"input_ids": (rows[0]["input_ids"] + rows[1]["input_ids"])[sl],
              "loss_weights": rows[0]["loss_weights"] + rows[1]["loss_weights"],
              "seq_lengths": [len(rows[0]["input_ids"]), len(rows[1]["input_ids"])]}
    flat = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=True, truncation_mode=mode)([packed])
    want = np.asarray(packed["loss_weights"], np.float32)[sl].copy()
    starts = np.flatnonzero(flat["position_ids"][0].numpy() == 0)
    want[starts] = 0.0
    np.testing.assert_array_equal(flat["loss_weights"][0].numpy(), want)


def test_mixed_batch_rows_without_weights_get_the_default():
    rows = weighted_rows()
    mixed = [rows[0], {"input_ids": rows[1]["input_ids"]}, rows[2]]
    for plw in (0.0, 0.25):
        out = CompletionCollator(markers=MARKERS, pad_token_id=0, prompt_loss_weight=plw)(mixed)
        plain = CompletionCollator(markers=MARKERS, pad_token_id=0)([{"input_ids": rows[1]["input_ids"]}])
        n = len(rows[1]["input_ids"])
        labels = plain["labels"][0]
        want = torch.where(labels != -100, 1.0, plw)
        want[0] = 0.0
        torch.testing.assert_close(out["loss_weights"][1, :n], want)
        assert (out["loss_weights"][1, n:] == 0).all()
        np.testing.assert_array_equal(out["labels"][1, :n].numpy(), labels.numpy())  # its labels: the markers'
        first = np.asarray(rows[0]["loss_weights"], np.float32)
        first[0] = 0
        np.testing.assert_array_equal(out["loss_weights"][0, : len(first)].numpy(), first)
    # without weights anywhere and prompt_loss_weight=0, no loss_weights: exactly as before
    assert "loss_weights" not in CompletionCollator(markers=MARKERS, pad_token_id=0)([{"input_ids": r["input_ids"]} for r in rows])


def test_weights_as_numpy_or_tensors_and_bad_weights_named():
    rows = weighted_rows()
    lists = CompletionCollator(markers=MARKERS, pad_token_id=0)(rows)
    for convert in (np.asarray, torch.tensor):
        other = [{**r, "loss_weights": convert(r["loss_weights"])} for r in rows]
        torch.testing.assert_close(CompletionCollator(markers=MARKERS, pad_token_id=0)(other)["loss_weights"], lists["loss_weights"])
    collate = CompletionCollator(markers=MARKERS, pad_token_id=0)
    with pytest.raises(ValueError, match="row 1 has 2 loss_weights for 12 input_ids"):
        collate([rows[0], {**rows[1], "loss_weights": [1.0, 1.0]}])
    with pytest.raises(ValueError, match="row 0 holds the loss weight -1.0 at position 3"):
        collate([{**rows[0], "loss_weights": [0.0, 1.0, 1.0, -1.0] + rows[0]["loss_weights"][4:]}])
    with pytest.raises(ValueError, match="finite and >= 0"):
        collate([{**rows[0], "loss_weights": [float("nan")] * len(rows[0]["input_ids"])}])


# -- the loss -------------------------------------------------------------------------------------


def test_weighted_cross_entropy_equals_hand_ce_per_token_and_per_sequence():
    torch.manual_seed(0)
    rows = weighted_rows()
    batch = CompletionCollator(markers=MARKERS, pad_token_id=0)(rows)
    logits = torch.randn(*batch["input_ids"].shape, 40, dtype=torch.float32)
    ids = [r["input_ids"] for r in rows]
    weights = [batch["loss_weights"][r, : len(row)].numpy() for r, row in enumerate(ids)]
    for per_sequence in (False, True):
        got = weighted_cross_entropy(logits, batch["input_ids"], batch["loss_weights"], per_sequence=per_sequence)
        want = hand_loss(logits.numpy(), ids, weights, per_sequence=per_sequence)
        assert float(got) == pytest.approx(want, rel=1e-6)
        # labels as the targets give the same loss (weights > 0 only where labels are set)
        assert float(weighted_cross_entropy(logits, batch["labels"], batch["loss_weights"], per_sequence=per_sequence)) == \
            pytest.approx(want, rel=1e-6)
    # padding-free: one flat row, sequences told by position_ids
    flat = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=True, pad_to_multiple_of=8)(rows)
    flat_logits = torch.randn(*flat["input_ids"].shape, 40)
    cu = np.cumsum([0] + [len(r) for r in ids])
    per_row_logits = [flat_logits[0, cu[i]: cu[i + 1]].numpy() for i in range(len(ids))]
    per_row_w = [flat["loss_weights"][0, cu[i]: cu[i + 1]].numpy() for i in range(len(ids))]
    for per_sequence in (False, True):
        got = weighted_cross_entropy(flat_logits, flat["input_ids"], flat["loss_weights"], per_sequence=per_sequence,
                                     position_ids=flat["position_ids"])
        assert float(got) == pytest.approx(hand_loss(per_row_logits, ids, per_row_w, per_sequence=per_sequence), rel=1e-6)
    # per-sequence weighs each sequence alike: scaling one row's weights changes nothing
    scaled = batch["loss_weights"].clone()
    scaled[0] *= 7
    torch.testing.assert_close(weighted_cross_entropy(logits, batch["input_ids"], scaled, per_sequence=True),
                               weighted_cross_entropy(logits, batch["input_ids"], batch["loss_weights"], per_sequence=True))
    zero = torch.zeros_like(batch["loss_weights"])
    assert float(weighted_cross_entropy(logits, batch["input_ids"], zero)) == 0.0
    assert float(weighted_cross_entropy(logits, batch["input_ids"], zero, per_sequence=True)) == 0.0


def test_share_of_accumulated_batch_sums_to_one():
    labels = [torch.tensor([[-100, 5, 6, -100]]), torch.tensor([[-100, 7, -100, -100], [-100, -100, 8, 9]])]
    total = sum(int((l[..., 1:] != -100).sum()) for l in labels)
    shares = [float(share_of_accumulated_batch(l, torch.tensor(total))) for l in labels]
    assert shares == pytest.approx([2 / 5, 3 / 5])


def _labelled_chats(tok, n=8):
    from test_collator import _chats

    rows = _chats(tok)[:n]
    markers = lossmask.detect_markers(tok)
    return [{"input_ids": r["input_ids"], "loss_weights": r["loss_weights"], "labels": r["labels"]}
            for r in weighted_rows(rows, markers, prompt=0.2)], markers


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))


def _hand_model_loss(model, rows, *, per_sequence=False):
    """The hand-computed weighted CE of a torch model, each row alone (no padding)."""
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([r["input_ids"]])).logits[0].numpy() for r in rows]
    weights = []
    for r in rows:
        w = np.asarray(r["loss_weights"], np.float64).copy()
        w[0] = 0.0
        weights.append(w)
    return hand_loss(logits, [r["input_ids"] for r in rows], weights, per_sequence=per_sequence)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_tiny_model_loss_func_equals_hand_weighted_ce(tok, padding_free, per_sequence):
    rows, markers = _labelled_chats(tok, 4)
    model = _tiny_llama(len(tok)).eval()
    batch = CompletionCollator(markers=markers, tokenizer=tok, padding_free=padding_free)(rows)
    loss = WeightedLoss(per_sequence=per_sequence).attach(model)
    labels = batch.pop("labels")
    with torch.no_grad():
        outputs = model(**batch)  # the hook takes loss_weights away from the model
        got = loss(outputs, labels)
    if padding_free:  # without flash attention the flat row attends across sequences: the CE of its own logits
        cu = np.cumsum([0] + [len(r["input_ids"]) for r in rows])
        logits = outputs.logits[0].numpy()
        weights = [batch["loss_weights"][0, cu[i]: cu[i + 1]].numpy() for i in range(len(rows))]
        want = hand_loss([logits[cu[i]: cu[i + 1]] for i in range(len(rows))], [r["input_ids"] for r in rows], weights,
                         per_sequence=per_sequence)
    else:
        want = _hand_model_loss(model, rows, per_sequence=per_sequence)
    assert float(got) == pytest.approx(want, rel=1e-6)
    # num_items_in_batch of this batch alone: the share is 1
    with torch.no_grad():
        again = loss(model(**batch), labels, num_items_in_batch=(labels[..., 1:] != -100).sum())
    assert float(again) == pytest.approx(float(got), rel=1e-6)


def _sft_args(tmp_path, **extra):
    from trl import SFTConfig

    settings = dict(max_steps=2, per_device_train_batch_size=4, bf16=False)  # float32: the hand CE to 1e-6
    settings.update(extra)
    return SFTConfig(output_dir=str(tmp_path), learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                     disable_tqdm=True, **settings)


class Recording(WeightedLoss):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.losses = []

    def __call__(self, outputs, labels, num_items_in_batch=None):
        value = super().__call__(outputs, labels, num_items_in_batch=num_items_in_batch)
        self.losses.append(float(value.detach()))
        return value


@pytest.mark.parametrize("per_sequence", [False, True])
def test_sft_trainer_with_compute_loss_func(tmp_path, tok, per_sequence):
    from datasets import Dataset
    from trl import SFTTrainer

    rows, markers = _labelled_chats(tok, 4)
    model = _tiny_llama(len(tok))
    initial = copy.deepcopy(model).eval()
    loss = Recording(per_sequence=per_sequence)
    trainer = SFTTrainer(model=model, args=_sft_args(tmp_path), train_dataset=Dataset.from_list(rows),
                         processing_class=tok, data_collator=CompletionCollator(markers=markers, tokenizer=tok, row_labels="keep"),
                         compute_loss_func=loss)
    loss.attach(trainer)
    trainer.train()
    assert len(loss.losses) == 2 and all(np.isfinite(loss.losses))
    # step 1: the whole dataset in one batch, before any update: the hand-computed weighted CE
    assert loss.losses[0] == pytest.approx(_hand_model_loss(initial, rows, per_sequence=per_sequence), rel=1e-6)
    assert loss.losses[1] < loss.losses[0]


def test_sft_trainer_with_the_mixin_and_gradient_accumulation(tmp_path, tok):
    from datasets import Dataset
    from trl import SFTTrainer

    rows, markers = _labelled_chats(tok, 4)
    seen = []

    class Trainer(WeightedLossMixin, SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"].clone()
            lengths = inputs["attention_mask"].sum(1).tolist()
            batch_rows = [ids[r, :n].tolist() for r, n in enumerate(lengths)]
            weights_seen = "loss_weights" in inputs
            value = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
            seen.append((weights_seen, float(value.detach()), num_items_in_batch, batch_rows))
            return value

    model = _tiny_llama(len(tok))
    initial = copy.deepcopy(model).eval()
    trainer = Trainer(model=model, args=_sft_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                                  max_steps=1),
                      train_dataset=Dataset.from_list(rows), processing_class=tok,
                      data_collator=CompletionCollator(markers=markers, tokenizer=tok))
    trainer.train()
    assert len(seen) == 2 and all(s[0] for s in seen)
    n_items = int(seen[0][2])  # the Trainer's count: trained targets of the accumulated batch
    assert n_items == sum(int((np.asarray(r["labels"][1:]) != -100).sum()) for r in rows)
    # each micro-batch: its weighted sum, by hand, over the weight of the whole accumulated batch
    by_id = {tuple(r["input_ids"]): r for r in rows}
    everything = _hand_model_loss(initial, rows)
    mass = sum(float(np.sum(r["loss_weights"][1:])) for r in rows)
    for _, value, _, batch_rows in seen:
        pair = [by_id[tuple(ids)] for ids in batch_rows]
        own = sum(float(np.sum(r["loss_weights"][1:])) for r in pair)
        assert value == pytest.approx(_hand_model_loss(initial, pair) * own / mass, rel=1e-6)
    assert sum(s[1] for s in seen) == pytest.approx(everything, rel=1e-6)


def _one_step(tmp_path, tok, rows, markers, *, batch, accumulation, per_sequence, mixin, switched=False):
    """One optimiser step of SFTTrainer (SGD) over ``rows``: the losses each micro-batch returned, and the weights
    after the step. ``switched``: the loss is attached with the other ``per_sequence`` and switched afterwards."""
    from datasets import Dataset
    from trl import SFTTrainer

    losses = []
    model = _tiny_llama(len(tok))
    extra = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, max_steps=1,
                 optim="sgd", max_grad_norm=0.0, lr_scheduler_type="constant", seed=0)
    collator = CompletionCollator(markers=markers, tokenizer=tok, row_labels="keep")
    if mixin:
        class Trainer(WeightedLossMixin, SFTTrainer):
            loss_per_sequence = per_sequence

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                value = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                             num_items_in_batch=num_items_in_batch)
                losses.append(float(value.detach()))
                return value

        trainer = Trainer(model=model, args=_sft_args(tmp_path, **extra), train_dataset=Dataset.from_list(rows),
                          processing_class=tok, data_collator=collator)
    else:
        loss = Recording(per_sequence=per_sequence != switched)
        trainer = SFTTrainer(model=model, args=_sft_args(tmp_path, **extra), train_dataset=Dataset.from_list(rows),
                             processing_class=tok, data_collator=collator, compute_loss_func=loss)
        loss.attach(trainer)
        loss.per_sequence = per_sequence
    trainer.train()
    return (losses if mixin else loss.losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mixin", [False, True], ids=["compute_loss_func", "mixin"])
@pytest.mark.parametrize("per_sequence", [False, True], ids=["per_token", "per_sequence"])
def test_gradient_accumulation_equals_one_batch_of_the_same_rows(tmp_path, tok, per_sequence, mixin):
    """Four rows of unequal weights: batch 2 x accumulation 2 gives the loss and the step of one batch of 4, to
    1e-5, however the rows fall into micro-batches (the weighted mean of the accumulated batch, not of each half)."""
    rows, markers = _labelled_chats(tok, 4)
    masses = [float(np.sum(r["loss_weights"][1:])) for r in rows]
    trained = [int((np.asarray(r["labels"][1:]) != -100).sum()) for r in rows]
    assert len({round(m / t, 3) for m, t in zip(masses, trained)}) > 1  # the weight per trained target differs
    whole, after_whole = _one_step(tmp_path / "whole", tok, rows, markers, batch=4, accumulation=1,
                                   per_sequence=per_sequence, mixin=mixin)
    halves, after_halves = _one_step(tmp_path / "halves", tok, rows, markers, batch=2, accumulation=2,
                                     per_sequence=per_sequence, mixin=mixin)
    assert len(whole) == 1 and len(halves) == 2
    assert sum(halves) == pytest.approx(whole[0], rel=1e-5)
    for a, b in zip(after_whole, after_halves):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_sequence", [False, True], ids=["per_token", "per_sequence"])
def test_per_sequence_switched_after_attach_takes_effect(tmp_path, tok, per_sequence):
    """A loss attached (as train_on_responses_only installs it) and then switched to the other mean divides each
    micro-batch by the accumulated batch's weight of the mean it now computes: the step is that of one batch."""
    rows, markers = _labelled_chats(tok, 4)
    whole, after_whole = _one_step(tmp_path / "whole", tok, rows, markers, batch=4, accumulation=1,
                                   per_sequence=per_sequence, mixin=False)
    halves, after_halves = _one_step(tmp_path / "halves", tok, rows, markers, batch=2, accumulation=2,
                                     per_sequence=per_sequence, mixin=False, switched=True)
    assert sum(halves) == pytest.approx(whole[0], rel=1e-5)
    for a, b in zip(after_whole, after_halves):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- the drop-in train_on_responses_only ----------------------------------------------------------


@pytest.fixture(scope="module")
def weighted_chats(tok):
    """``mask_dataset`` output of a few chats with a hand-made ``loss_weights`` column (labels follow it)."""
    from datasets import Dataset

    from lossmask.hf import mask_dataset

    convs = [[{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"It is {a + b}."},
              {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"{2 * (a + b)}."}]
             for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    masked = mask_dataset(Dataset.from_dict({"messages": convs}), tok, verbose=False)
    weights = [hand_weights(labels, prompt=0.2, seed=i).tolist() for i, labels in enumerate(masked["labels"])]
    labels = [[t if w > 0 else -100 for t, w in zip(ids, ws)] for ids, ws in zip(masked["input_ids"], weights)]
    return masked.remove_columns("labels").add_column("labels", labels).add_column("loss_weights", weights)


@pytest.mark.parametrize("setup", ["padded", "truncated", "padding_free", "mixin"])
def test_drop_in_keeps_loss_weights(tmp_path, tok, weighted_chats, setup):
    from trl import SFTTrainer

    from lossmask.hf import PadByPosition, train_on_responses_only

    extra = {"max_length": 30} if setup == "truncated" else {"padding_free": True, "max_length": None} if setup == "padding_free" else {}
    seen = []

    bases = (WeightedLossMixin, SFTTrainer) if setup == "mixin" else (SFTTrainer,)

    class Base(*bases):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    model = _tiny_llama(len(tok))
    initial = copy.deepcopy(model).eval()
    trainer = Base(model=model, args=_sft_args(tmp_path, max_steps=1, **extra), train_dataset=weighted_chats,
                   processing_class=tok)
    with _no_warning():  # rows kept as they are: no "labelled from ids" warning
        train_on_responses_only(trainer, verbose=False)
    assert "loss_weights" in trainer.train_dataset.column_names
    if setup == "padding_free":
        assert isinstance(trainer.data_collator, CompletionCollator)
    else:
        assert isinstance(trainer.data_collator, PadByPosition)
    if setup == "mixin":
        assert trainer.compute_loss_func is None
    else:
        assert isinstance(trainer.compute_loss_func, WeightedLoss)
    recorded = []
    if setup != "mixin":
        compute = trainer.compute_loss_func

        def recording(outputs, labels, num_items_in_batch=None):
            value = compute(outputs, labels, num_items_in_batch=num_items_in_batch)
            recorded.append(float(value.detach()))
            return value

        trainer.compute_loss_func = recording
    trainer.train()
    batch = seen[0]
    assert "loss_weights" in batch  # kept through remove_unused_columns and the collator
    # the batch's rows: the dataset's rows, cut to the trainer's max_length with their weights
    cut = 30 if setup == "truncated" else None
    rows = [{"input_ids": r["input_ids"][:cut], "loss_weights": r["loss_weights"][:cut]} for r in weighted_chats]
    by_id = {tuple(r["input_ids"]): r for r in rows}
    if setup == "padding_free":
        starts = np.flatnonzero(batch["position_ids"][0].numpy() == 0).tolist() + [batch["input_ids"].shape[1]]
        pieces = [batch["input_ids"][0, a:b].tolist() for a, b in zip(starts, starts[1:])]
    else:
        lengths = batch["attention_mask"].sum(1).tolist()
        pieces = [batch["input_ids"][r, :n].tolist() for r, n in enumerate(lengths)]
    in_batch = [by_id[tuple(p)] for p in pieces if tuple(p) in by_id]
    assert len(in_batch) == 4  # per_device_train_batch_size
    for r in in_batch:
        w = np.asarray(r["loss_weights"], np.float32)
        labels = np.where(w > 0, r["input_ids"], -100)
        assert np.isin(np.asarray(r["input_ids"]), batch["input_ids"].numpy()).all() and len(labels) == len(w)
    want = _hand_model_loss(initial, in_batch)
    if setup == "padding_free":  # the flat row attends across sequences without flash attention: no hand value
        assert np.isfinite(recorded[0])
    elif setup == "mixin":
        with torch.no_grad():
            logits = initial(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = weighted_cross_entropy(logits, batch["input_ids"], batch["loss_weights"])
        assert float(got) == pytest.approx(want, rel=1e-6)
    else:
        assert recorded[0] == pytest.approx(want, rel=1e-6)


class _no_warning:
    def __enter__(self):
        import warnings

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error", UserWarning)

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def test_pad_by_position_carries_weights():
    from lossmask.hf import PadByPosition

    rows = [{"input_ids": [1, 2, 3, 4], "loss_weights": [0.5, 0.0, 2.0, 1.0, 9.0]},  # one weight more: cut (keep_start)
            {"input_ids": [5, 6], "labels": [-100, 6]}]  # no weights: 1 on its labelled tokens
    out = PadByPosition(pad_token_id=0, padding_side="left")(rows)
    np.testing.assert_array_equal(out["loss_weights"].numpy(), [[0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    np.testing.assert_array_equal(out["labels"].numpy(), [[-100, -100, 3, 4], [-100, -100, -100, 6]])
    end = PadByPosition(pad_token_id=0, truncation_mode="keep_end")(rows[:1])
    np.testing.assert_array_equal(end["loss_weights"].numpy(), [[0.0, 2.0, 1.0, 9.0]])
    with pytest.raises(ValueError, match="row 0 has 2 loss_weights for 4 input_ids"):
        PadByPosition(pad_token_id=0)([{"input_ids": [1, 2, 3, 4], "loss_weights": [1.0, 1.0]}])
    assert "loss_weights" not in PadByPosition(pad_token_id=0)([rows[1]])


def test_transformers_trainer_with_compute_loss_func(tmp_path, tok):
    """transformers' own Trainer: remove_unused_columns keeps loss_weights once the loss is attached."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    rows, markers = _labelled_chats(tok, 4)
    model = _tiny_llama(len(tok))
    initial = copy.deepcopy(model).eval()
    loss = Recording()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                      data_collator=CompletionCollator(markers=markers, tokenizer=tok), compute_loss_func=loss)
    loss.attach(trainer)
    trainer.train()
    assert len(loss.losses) == 2
    assert loss.losses[0] == pytest.approx(_hand_model_loss(initial, rows), rel=1e-6)


def test_drop_in_with_rows_packed_beforehand(tmp_path, tok, weighted_chats):
    """trl's pack_dataset packs every list column, loss_weights too (TRL's own packing=True keeps only
    input_ids and labels): packed rows keep their weights through the drop-in's padding-free collator."""
    from trl import SFTTrainer
    from trl.data_utils import pack_dataset

    from lossmask.hf import train_on_responses_only

    packed = pack_dataset(weighted_chats.select_columns(["input_ids", "labels", "loss_weights"]), 128, "bfd")
    assert "loss_weights" in packed.column_names
    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    trainer = Recording(model=_tiny_llama(len(tok)), args=_sft_args(tmp_path, max_steps=1, padding_free=True, max_length=None),
                        train_dataset=packed, processing_class=tok)
    train_on_responses_only(trainer, verbose=False)
    assert isinstance(trainer.data_collator, CompletionCollator) and trainer.data_collator.padding_free
    assert isinstance(trainer.compute_loss_func, WeightedLoss)
    trainer.train()
    batch = seen[0]
    flat_ids = batch["input_ids"][0].tolist()
    flat_w = batch["loss_weights"][0].numpy()
    starts = np.flatnonzero(batch["position_ids"][0].numpy() == 0).tolist() + [len(flat_ids)]
    by_id = {tuple(r["input_ids"]): np.asarray(r["loss_weights"], np.float32) for r in weighted_chats}
    found = 0
    for a, b in zip(starts, starts[1:]):
        want = by_id.get(tuple(flat_ids[a:b]))
        if want is not None:
            want = want.copy()
            want[0] = 0.0
            np.testing.assert_array_equal(flat_w[a:b], want)
            found += 1
    assert found == 4
