"""The MLX-LM feed: reading mlx-lm data folders, batches with engine masks, the loss, and a tiny
mlx-lm model training a few steps on CPU with the loss over exactly the trained tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lossmask

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from lossmask import mlx as lm  # noqa: E402

from conftest import tokenizer_path  # noqa: E402

# most folders here hold no valid.jsonl on purpose; the warning itself is tested below
pytestmark = pytest.mark.filterwarnings("ignore:.*has no valid.jsonl:UserWarning")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def chat_rows(n=10, *, vary=True):
    rows = []
    for i in range(n):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} plus {i}?" + " Please." * (i % 4 if vary else 1)},
            {"role": "assistant", "content": f"<|tool_call_start|>[add(a={i})]<|tool_call_end|>"},
            {"role": "tool", "content": f"{2 * i}"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
        rows.append({"messages": messages, "tools": TOOLS})
    return rows


def write(folder, split, rows):
    folder.mkdir(exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))


@pytest.fixture(scope="module")
def markers(tok):
    return lossmask.detect_markers(tok)


def test_every_assistant_turn_trains_and_padding_never(tmp_path, tok, markers):
    folder = write(tmp_path / "d", "train", chat_rows())
    write(folder, "valid", chat_rows(4))
    train, valid, test = lm.load_dataset(folder, tok, markers=markers)
    assert len(train) == 10 and len(valid) == 4 and test == []
    seen = 0
    for tokens, trained, lengths in lm.iterate_batches(train, 2, 2048):
        tokens, trained, lengths = np.array(tokens), np.array(trained), np.array(lengths)
        for r in range(len(tokens)):
            row = tokens[r, : lengths[r]]
            want = np.asarray(lossmask.make_labels([row.tolist()], markers)[0]) != -100
            np.testing.assert_array_equal(trained[r, : lengths[r]], want)
            assert not trained[r, lengths[r]:].any()
            # both assistant actions train: the tool call and the final answer, each through <|im_end|> (7)
            assert (row[want] == 7).sum() == 2
            seen += 1
    assert seen == 10  # loop=False: one pass, every row once


def test_batches_sorted_bucketed_and_seeded(tmp_path, tok, markers):
    train, _, _ = lm.load_dataset(write(tmp_path / "d", "train", chat_rows(12)), tok, markers=markers)
    batches = list(lm.iterate_batches(train, 3, 2048, seed=1))
    assert len(batches) == 4
    groups = sorted(tuple(np.array(b[2]).tolist()) for b in batches)
    flat = [n for g in groups for n in g]
    assert flat == sorted(train.lengths.tolist())  # groups of neighbours in token length
    assert all(b[0].shape[1] in {lm.batch_width(n, 2048) for n in range(1, 200)} for b in batches)
    assert len({lm.batch_width(n, 4096) for n in range(1, 4097)}) <= 57  # mlx-lm pads to multiples of 32: 128 widths
    again = [np.array(b[2]).tolist() for b in lm.iterate_batches(train, 3, 2048, seed=1)]
    assert again == [np.array(b[2]).tolist() for b in batches]
    looped = lm.iterate_batches(train, 3, 2048, loop=True)
    assert len([next(looped) for _ in range(9)]) == 9
    short = list(lm.iterate_batches(train, 3, 16))  # cut at max_seq_length
    assert all(b[0].shape[1] == 16 and int(np.array(b[2]).max()) == 16 for b in short)


def test_text_rows_with_mask_prompt_train_every_token_with_a_note_as_lossmask_lora_does(tmp_path, tok, markers):
    text = write(tmp_path / "text", "train", [{"text": "hello"}, {"text": "plain text"}])
    with pytest.warns(UserWarning, match="no turns to mask: every token trains"):
        train, _, _ = lm.load_dataset(text, tok, markers=markers)
    tokens, trained, lengths = next(lm.iterate_batches(train, 2, 2048))
    assert int(np.array(trained).sum()) == int(np.array(lengths).sum())


def test_completions_text_and_feature_names(tmp_path, tok, markers):
    rows = [{"q": f"Say {i}", "a": f"{i}"} for i in range(4)]
    train, _, _ = lm.load_dataset(write(tmp_path / "c", "train", rows), tok, markers=markers,
                                  prompt_feature="q", completion_feature="a")
    for tokens, trained, lengths in lm.iterate_batches(train, 4, 2048):
        assert int(np.array(trained).sum()) == int(train.counts.tokens_trained)
    texts = [{"body": f"plain text {i}"} for i in range(4)]
    train, _, _ = lm.load_dataset(write(tmp_path / "t", "train", texts), tok, mask_prompt=False, text_feature="body")
    assert all(train[i][0][-1] == tok.eos_token_id for i in range(4))  # EOS appended, as mlx-lm does
    tokens, trained, lengths = next(lm.iterate_batches(train, 4, 2048))
    assert int(np.array(trained).sum()) == int(np.array(lengths).sum())


def test_clear_errors_where_mlx_lm_crashes_or_is_silent(tmp_path, tok, markers):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows; put one JSON object per line in it$"):
        lm.load_dataset(empty, tok, markers=markers)  # train is required: no advice to remove it
    mixed = write(tmp_path / "mixed", "train", chat_rows(2) + [{"text": "hello"}])
    with pytest.raises(ValueError, match="mixes row shapes: row 0 is chat, row 2 is text"):
        lm.load_dataset(mixed, tok, markers=markers)
    odd = write(tmp_path / "odd", "train", [{"question": "?"}])
    with pytest.raises(ValueError, match="chat_feature="):
        lm.load_dataset(odd, tok, markers=markers)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match="train.jsonl:2 is not valid JSON"):
        lm.load_dataset(broken, tok, mask_prompt=False)
    with pytest.raises(ValueError, match="no train.jsonl"):
        lm.load_dataset(tmp_path, tok, markers=markers)
    with pytest.raises(TypeError, match="MaskedDataset"):
        next(lm.iterate_batches([([1, 2], 0)] * 4, 2, 16))
    with pytest.raises(ValueError, match="prompt_loss_weight=-1"):
        lm.make_loss(prompt_loss_weight=-1)
    # markers of another template match nothing: every row would train nothing, which is an error, not silence
    wrong = lossmask.Markers(response=[[4000, 4001]], end=[[7]])
    with pytest.raises(lossmask.TooManyDroppedRows, match="train.jsonl: 3 of 3 rows"):
        lm.load_dataset(write(tmp_path / "wrong", "train", chat_rows(3)), tok, markers=wrong)
    kept, _, _ = lm.load_dataset(tmp_path / "wrong", tok, markers=wrong, max_drop_fraction=1.0, drop_untrained=False)
    assert len(kept) == 3 and kept.counts.dropped["no_response"] == 3


def _tiny_model(vocab_size):
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab_size)
    return llama.Model(args)


def _manual_ce(model, tokens, weights):
    import mlx.nn as nn

    logits = model(tokens[:, :-1])
    ce = nn.losses.cross_entropy(logits, tokens[:, 1:])
    return float((ce * weights[:, 1:]).sum() / weights[:, 1:].sum())


@pytest.mark.parametrize("prompt_loss_weight", [0.0, 0.3])
def test_loss_counts_exactly_trained_tokens(tmp_path, tok, markers, prompt_loss_weight):
    train, _, _ = lm.load_dataset(write(tmp_path / "d", "train", chat_rows(4)), tok, markers=markers)
    model = _tiny_model(len(tok))
    tokens, trained, lengths = next(lm.iterate_batches(train, 4, 2048))
    loss, n = lm.make_loss(prompt_loss_weight=prompt_loss_weight)(model, tokens, trained, lengths)
    real = mx.arange(tokens.shape[1])[None, :] < lengths[:, None]
    start = mx.arange(tokens.shape[1])[None, :] == 0
    weights = mx.where(trained, 1.0, mx.where(mx.logical_and(real, mx.logical_not(start)), prompt_loss_weight, 0.0))
    if prompt_loss_weight == 0:
        assert int(n) == int(train.counts.tokens_trained)  # not one padding target more
    assert float(n) == pytest.approx(float(weights[:, 1:].sum()), rel=1e-5)
    assert float(loss) == pytest.approx(_manual_ce(model, tokens, weights), rel=1e-5)


def test_mlx_lm_trainer_runs_with_feed(tmp_path, tok, markers):
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, evaluate, train

    # rows of one length: one batch shape, so the trainer compiles its step once (~seconds on the CPU)
    folder = write(tmp_path / "d", "train", chat_rows(8, vary=False))
    write(folder, "valid", chat_rows(4, vary=False))
    train_set, valid_set, _ = lm.load_dataset(folder, tok, markers=markers)
    model = _tiny_model(len(tok))
    before = evaluate(model, valid_set, batch_size=2, num_batches=-1, loss=lm.masked_loss, iterate_batches=lm.iterate_batches)
    reports = []

    class Callback:
        def on_train_loss_report(self, info):
            reports.append(info)

        def on_val_loss_report(self, info):
            pass

    args = TrainingArgs(batch_size=2, iters=6, val_batches=2, steps_per_report=3, steps_per_eval=100,
                        steps_per_save=100, adapter_file=str(tmp_path / "adapters.safetensors"))
    train(model, optim.Adam(learning_rate=1e-2), train_set, valid_set, args=args, loss=lm.masked_loss,
          iterate_batches=lm.iterate_batches, training_callback=Callback())
    after = evaluate(model, valid_set, batch_size=2, num_batches=-1, loss=lm.masked_loss, iterate_batches=lm.iterate_batches)
    assert np.isfinite(before) and np.isfinite(after) and after < before
    assert len(reports) == 2 and all(np.isfinite(r["train_loss"]) for r in reports)
    # the trainer's token count is the trained tokens of the batches it saw, no padding targets
    per_row = lossmask.label_batch([train_set[i][0] for i in range(len(train_set))], markers).trained_tokens
    assert len(set(per_row.tolist())) == 1  # every row trains as many tokens, so the total is known
    assert reports[-1]["trained_tokens"] == 6 * 2 * int(per_row[0])


def test_accepts_mlx_lm_tokenizer_wrapper(tmp_path, tok, markers):
    """mlx_lm.load returns a TokenizerWrapper; the feed takes it as it is."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    folder = write(tmp_path / "d", "train", chat_rows(4))
    wrapped, _, _ = lm.load_dataset(folder, TokenizerWrapper(tok))
    plain, _, _ = lm.load_dataset(folder, tok, markers=markers)
    assert [wrapped[i][0] for i in range(4)] == [plain[i][0] for i in range(4)]
    assert wrapped.counts.tokens_trained == plain.counts.tokens_trained


def test_split_messages_follow_mlx_lm(tmp_path, tok, markers):
    folder = write(tmp_path / "d", "train", chat_rows(4))
    with pytest.warns(UserWarning, match="has no valid.jsonl: training goes on without validation"):
        train, valid, test = lm.load_dataset(folder, tok, markers=markers)
    assert valid == [] and test == []
    (folder / "valid.jsonl").write_text("")
    with pytest.raises(ValueError, match="valid.jsonl has no rows; .*or remove the file to go without a valid split"):
        lm.load_dataset(folder, tok, markers=markers)
    with pytest.raises(ValueError, match=r"empty split \(\[\]\).*valid.jsonl or test.jsonl"):
        next(lm.iterate_batches(test, 2, 64))


def test_global_seed_fixes_the_order_as_mlx_lm_lora_seed(tmp_path, tok, markers):
    train, _, _ = lm.load_dataset(write(tmp_path / "d", "train", chat_rows(16)), tok, markers=markers)

    def order():
        return [np.array(b[2]).tolist() for b in lm.iterate_batches(train, 2, 2048)]

    np.random.seed(0)  # what `mlx_lm lora --seed 0` does before training
    first = order()
    np.random.seed(0)
    assert order() == first
    np.random.seed(1)
    assert order() != first  # 8 groups: a different seed gives another order
    state = np.random.get_state()[1].copy()
    assert [np.array(b[2]).tolist() for b in lm.iterate_batches(train, 2, 2048, seed=3)] == \
        [np.array(b[2]).tolist() for b in lm.iterate_batches(train, 2, 2048, seed=3)]
    assert (np.random.get_state()[1] == state).all()  # an explicit seed leaves the global generator alone


def test_parquet_split_from_lossmask_mask(tmp_path, tok, markers):
    """`lossmask mask` output is a split too: its labels are used as they are."""
    import pyarrow.parquet as pq

    folder = write(tmp_path / "jsonl", "train", chat_rows(6))
    masked = tmp_path / "masked"
    masked.mkdir()
    report = lossmask.mask_files(folder / "train.jsonl", masked / "train.parquet", tokenizer=tok, markers=markers,
                                 keep_dropped=True)
    assert report.rows_out == 6
    from_jsonl, _, _ = lm.load_dataset(folder, tok, markers=markers)
    from_parquet, _, _ = lm.load_dataset(masked, tok, markers=markers)
    a, b = next(lm.iterate_batches(from_jsonl, 6, 2048, seed=0)), next(lm.iterate_batches(from_parquet, 6, 2048, seed=0))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert from_parquet.counts.tokens_trained == from_jsonl.counts.tokens_trained
    # rows whose labels train nothing are dropped and counted with the reason the markers give
    table = pq.read_table(masked / "train.parquet")
    labels = table.column("labels").to_pylist()
    labels[0] = [-100] * len(labels[0])
    ids = table.column("input_ids").to_pylist()
    ids[1], labels[1] = [], []
    pq.write_table(pa_table(ids, labels), masked / "train.parquet")
    dropped, _, _ = lm.load_dataset(masked, tok, markers=markers, max_drop_fraction=0.5)
    assert len(dropped) == 4
    assert dropped.counts.dropped == {"no_response": 1, "empty_response": 0, "empty": 1}
    (masked / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match="both train.jsonl and train.parquet"):
        lm.load_dataset(masked, tok, markers=markers)


def pa_table(ids, labels):
    import pyarrow as pa

    return pa.table({"input_ids": pa.array(ids, pa.large_list(pa.int32())), "labels": pa.array(labels, pa.large_list(pa.int64()))})


def test_the_shape_policy_applies_to_the_feed_too(tmp_path):
    """The conversation-shape policy on the mlx-lm path: Phi-3 would train the second of two user messages; a leading
    assistant message is dropped, as ``lossmask mask`` drops it."""
    phi = lossmask.load_tokenizer(str(tokenizer_path("phi-3")))
    rows = [{"messages": [{"role": "user", "content": "666"}, {"role": "user", "content": "what does this number mean?"},
                          {"role": "assistant", "content": "666 is called the number of the beast."}]},
            {"messages": [{"role": "assistant", "content": "Sure, here is the rest."}, {"role": "user", "content": "Thanks."},
                          {"role": "assistant", "content": "It reads the file."}]}]
    train, _, _ = lm.load_dataset(write(tmp_path / "p", "train", rows), phi)
    spans = zip(train.offsets[:-1], train.offsets[1:])
    decoded = [phi.tokenizer.decode(train.values[a:b][train.trained_values[a:b]].tolist()) for a, b in spans]
    assert "number mean" not in decoded[0] and "number of the beast" in decoded[0]
    assert "here is the rest" not in decoded[1] and "reads the file" in decoded[1]
    with pytest.raises(ValueError, match=r"row 0: no user message"):
        lm.load_dataset(write(tmp_path / "q", "train", [{"messages": [{"role": "assistant", "content": "Only me."}]}]), phi)


# -- per-token loss weights -------------------------------------------------------------------------


def hand_weights(labels, seed=0):
    """Hand-chosen weights for a labelled row: trained tokens 0, 0.5, 1 or 2.5, the other tokens 0.1 or 0."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    trained = rng.choice([0.0, 0.5, 1.0, 2.5], size=len(labels), p=[0.2, 0.3, 0.3, 0.2])
    return np.where(labels != -100, trained, rng.choice([0.0, 0.1], size=len(labels))).astype(np.float32)


def weighted_split(tok, markers, src, dest):
    """`lossmask mask` output of ``src`` with a hand-made ``loss_weights`` column (labels follow the weights)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    lossmask.mask_files(src, dest, tokenizer=tok, markers=markers)
    table = pq.read_table(dest)
    ids = table.column("input_ids").to_pylist()
    weights = [hand_weights(labels, seed=i) for i, labels in enumerate(table.column("labels").to_pylist())]
    labels = [[t if w > 0 else -100 for t, w in zip(row, ws)] for row, ws in zip(ids, weights)]
    out = pa.table({"input_ids": pa.array(ids, pa.large_list(pa.int32())), "labels": pa.array(labels, pa.large_list(pa.int64())),
                    "loss_weights": pa.array([w.tolist() for w in weights], pa.large_list(pa.float32()))})
    pq.write_table(out, dest)
    return ids, weights


def hand_weighted_ce(model, ids_rows, weight_rows, *, per_sequence=False):
    """sum(w * nll) / sum(w) over next-token targets, row by row (no batch, no padding), in NumPy float64."""
    totals, masses = [], []
    for ids, w in zip(ids_rows, weight_rows):
        logits = np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32), dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        nll = top[:, 0] + np.log(np.exp(logits - top).sum(-1)) - logits[np.arange(len(ids) - 1), ids[1:]]
        totals.append(float((nll * np.asarray(w[1:], np.float64)).sum()))
        masses.append(float(np.asarray(w[1:], np.float64).sum()))
    if per_sequence:
        means = [t / m for t, m in zip(totals, masses) if m > 0]
        return sum(means) / len(means), len(means)
    return sum(totals) / sum(masses), sum(masses)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_weighted_split_loss_equals_hand_weighted_ce(tmp_path, tok, markers, per_sequence):
    folder = write(tmp_path / "jsonl", "train", chat_rows(4))
    (tmp_path / "masked").mkdir()
    ids, weights = weighted_split(tok, markers, folder / "train.jsonl", tmp_path / "masked" / "train.parquet")
    train, _, _ = lm.load_dataset(tmp_path / "masked", tok, markers=markers)
    assert train.weight_values is not None and len(train) == 4
    batch = next(lm.iterate_batches(train, 4, 2048, seed=0))
    tokens, trained, lengths, w = batch
    assert w.dtype == mx.float32 and w.shape == tokens.shape
    real = np.arange(tokens.shape[1])[None, :] < np.array(lengths)[:, None]
    assert (np.array(w)[~real] == 0).all()  # padding: weight 0
    np.testing.assert_array_equal(np.array(trained)[real], np.array(w)[real] > 0)
    model = _tiny_model(len(tok))
    loss, n = lm.make_loss(per_sequence=per_sequence)(model, *batch)
    want, mass = hand_weighted_ce(model, ids, weights, per_sequence=per_sequence)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(n) == pytest.approx(mass, rel=1e-6)
    # the same rows as JSON lines (input_ids, labels, loss_weights) load and batch alike
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "masked" / "train.parquet").to_pylist()
    as_jsonl = write(tmp_path / "tokens", "train", rows)
    again, _, _ = lm.load_dataset(as_jsonl, tok, markers=markers)
    for x, y in zip(batch, next(lm.iterate_batches(again, 4, 2048, seed=0))):
        np.testing.assert_array_equal(np.array(x), np.array(y))


def test_weights_drop_rows_that_train_nothing_and_bad_weights_are_named(tmp_path, tok, markers):
    import pyarrow as pa

    ids = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    weights = [[0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0]]
    ds = lm.MaskedDataset(ids, markers, loss_weights=weights, max_drop_fraction=0.5)
    assert len(ds) == 2 and ds.counts.dropped["no_response"] + ds.counts.dropped["empty_response"] == 1
    np.testing.assert_array_equal(ds.weight_values, np.array([0.0, 0.5, 1.0, 0.0, 0.0, 2.0], np.float32))
    tokens, trained, lengths, w = next(lm.iterate_batches(ds, 2, 2048, seed=0))
    assert sorted(np.array(w).sum(1).tolist()) == [1.5, 2.0]
    with pytest.raises(ValueError, match="row 1 has 2 loss_weights for 3 input_ids"):
        lm.MaskedDataset(ids, markers, loss_weights=[weights[0], [0.0, 1.0], weights[2]])
    with pytest.raises(ValueError, match="row 2 holds the loss weight -1.0"):
        lm.MaskedDataset(ids, markers, loss_weights=[weights[0], weights[1], [0.0, -1.0]], max_drop_fraction=1.0)
    column = pa.array(weights, pa.list_(pa.float64()))  # any float list type is read
    assert len(lm.MaskedDataset(ids, markers, loss_weights=column, max_drop_fraction=0.5)) == 2
    with pytest.raises(ValueError, match="row 1 has keys"):
        lm.load_dataset(write(tmp_path / "t", "train", [{"input_ids": [1, 2], "loss_weights": [0, 1]}, {"input_ids": [3, 4]}]),
                        tok, markers=markers)


def test_mlx_lm_trainer_runs_on_weighted_rows(tmp_path, tok, markers):
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, evaluate, train

    folder = write(tmp_path / "d", "train", chat_rows(8, vary=False))
    write(folder, "valid", chat_rows(4, vary=False))
    masked = tmp_path / "masked"
    masked.mkdir()
    for split in ("train", "valid"):
        weighted_split(tok, markers, folder / f"{split}.jsonl", masked / f"{split}.parquet")
    train_set, valid_set, _ = lm.load_dataset(masked, tok, markers=markers)
    model = _tiny_model(len(tok))
    loss = lm.make_loss()
    before = evaluate(model, valid_set, batch_size=2, num_batches=-1, loss=loss, iterate_batches=lm.iterate_batches)
    args = TrainingArgs(batch_size=2, iters=4, val_batches=2, steps_per_report=2, steps_per_eval=100,
                        steps_per_save=100, adapter_file=str(tmp_path / "adapters.safetensors"))
    train(model, optim.Adam(learning_rate=1e-2), train_set, valid_set, args=args, loss=loss, iterate_batches=lm.iterate_batches)
    after = evaluate(model, valid_set, batch_size=2, num_batches=-1, loss=loss, iterate_batches=lm.iterate_batches)
    assert np.isfinite(before) and np.isfinite(after) and after < before
