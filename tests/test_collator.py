"""The collator: engine labels on padded / padding-free / packed batches, TRL's batch layout, and a
few real SFTTrainer steps on CPU whose loss counts exactly the trained tokens."""

from __future__ import annotations

import numpy as np
import pytest

import lossmask
from lossmask import Markers

torch = pytest.importorskip("torch")
from lossmask.collator import CompletionCollator, PromptWeightedLossMixin, prompt_weighted_loss  # noqa: E402

from conftest import tokenizer_path  # noqa: E402
from backend_cases import markers as random_markers  # noqa: E402
from backend_cases import rows as random_rows  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# ChatML-like ids; the pad id equals the end-of-turn id, as it often does (pad == eos)
START, ASSISTANT, USER, NL, END = 1, 2, 3, 4, 5
MARKERS = Markers(response=[[START, ASSISTANT, NL]], instruction=[[START]], end=[[END]])


def chat(*turns):
    ids = []
    for role, content in turns:
        ids += [START, ASSISTANT if role == "a" else USER, NL, *content, END, NL]
    return ids


ROWS = [
    chat(("u", [10, 11]), ("a", [12, 13, 14]), ("u", [15]), ("a", [16])),
    chat(("u", [20]), ("a", [21])),
    [START, USER, NL, 30, END, NL, START, ASSISTANT, NL],  # truncated after the header: nothing trains
    [],
]


def engine_labels(rows):
    return [np.asarray(r, dtype=np.int64) for r in lossmask.make_labels(rows, MARKERS)]


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_labels_equal_engine_and_pad_eq_eos_keeps_eos(side):
    batch = CompletionCollator(markers=MARKERS, pad_token_id=END, padding_side=side, pad_to_multiple_of=8)(
        [{"input_ids": r} for r in ROWS]
    )
    ids, labels, attn = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["attention_mask"].numpy()
    assert ids.shape == (4, 32) and labels.shape == ids.shape
    for r, (row, want) in enumerate(zip(ROWS, engine_labels(ROWS))):
        real = slice(0, len(row)) if side == "right" else slice(ids.shape[1] - len(row), ids.shape[1])
        np.testing.assert_array_equal(ids[r, real], row)
        np.testing.assert_array_equal(labels[r, real], want)
        assert attn[r].sum() == len(row) and (attn[r, real] == 1).all()
        assert (labels[r][attn[r] == 0] == -100).all()  # padding (id END) is never trained
    assert (labels[0] == END).sum() == 2  # the real stop tokens are


def test_padded_batch_is_trl_batch_with_engine_labels():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    ours = CompletionCollator(markers=MARKERS, pad_token_id=0, return_position_ids=True)([{"input_ids": r} for r in ROWS])
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)(
        [{"input_ids": r, "labels": lab.tolist()} for r, lab in zip(ROWS, engine_labels(ROWS))]
    )
    assert set(ours) == set(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], msg=key)


@pytest.mark.parametrize("multiple", [None, 16])
def test_padding_free_batch_is_trl_batch_with_engine_labels(multiple):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = [r for r in ROWS if r]
    ours = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple)(
        [{"input_ids": r} for r in rows]
    )
    theirs = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=multiple)(
        [{"input_ids": r, "labels": lab.tolist()} for r, lab in zip(rows, engine_labels(rows))]
    )
    assert set(ours) == set(theirs)
    for key in theirs:
        if isinstance(theirs[key], torch.Tensor):
            torch.testing.assert_close(ours[key], theirs[key], msg=key)
        else:
            assert ours[key] == theirs[key], key


def test_packed_rows_label_each_sequence():
    a, b, c = ROWS[0], ROWS[1], ROWS[2]
    examples = [{"input_ids": a + b, "seq_lengths": [len(a), len(b)]}, {"input_ids": c, "seq_lengths": [len(c)]}]
    want = engine_labels([a, b, c])
    for padding_free in (False, True):
        batch = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=padding_free)(examples)
        labels = batch["labels"].numpy()
        if padding_free:
            np.testing.assert_array_equal(labels[0], np.concatenate(want))
            np.testing.assert_array_equal(batch["cu_seq_lens_q"].numpy(), np.cumsum([0, len(a), len(b), len(c)]))
        else:
            np.testing.assert_array_equal(labels[0, : len(a) + len(b)], np.concatenate(want[:2]))
            np.testing.assert_array_equal(labels[1, : len(c)], want[2])
    # a sequence that starts with what would be a trained token is masked at its start
    glued = [{"input_ids": [START, ASSISTANT, NL, 7, 8], "seq_lengths": [4, 1]}]
    labels = CompletionCollator(markers=MARKERS, pad_token_id=0)(glued)["labels"].numpy()
    np.testing.assert_array_equal(labels[0], [-100, -100, -100, 7, -100])


@settings(max_examples=40, deadline=None)
@given(batch=random_rows, m=random_markers(), side=st.sampled_from(["right", "left"]), padding_free=st.booleans(),
       pack=st.integers(1, 3), multiple=st.sampled_from([None, 8]))
def test_collator_equals_reference_per_sequence(batch, m, side, padding_free, pack, multiple):
    from lossmask.engine.kernels import reference

    seqs = [list(r or []) for r in batch]
    if not seqs:
        return
    examples = [  # `pack` sequences per row, with TRL's seq_lengths
        {"input_ids": [t for s_ in seqs[i : i + pack] for t in s_], "seq_lengths": [len(s_) for s_ in seqs[i : i + pack]]}
        for i in range(0, len(seqs), pack)
    ]
    out = CompletionCollator(markers=m, pad_token_id=0, padding_side=side, padding_free=padding_free,
                             pad_to_multiple_of=multiple)(examples)
    labels, ids = out["labels"].numpy(), out["input_ids"].numpy()
    want = [np.where(reference.trained_positions(np.asarray(s_, np.int64), m)[0], s_, -100) for s_ in seqs]
    if padding_free:
        flat = np.concatenate(want) if want else np.zeros(0)
        np.testing.assert_array_equal(labels[0, : len(flat)], flat)
        assert (labels[0, len(flat):] == -100).all()
        return
    for r, example in enumerate(examples):
        n = len(example["input_ids"])
        real = slice(0, n) if side == "right" else slice(ids.shape[1] - n, ids.shape[1])
        np.testing.assert_array_equal(ids[r, real], example["input_ids"])
        row_want = np.concatenate(want[r * pack : r * pack + pack]) if n else np.zeros(0)
        np.testing.assert_array_equal(labels[r, real], row_want)
        assert (labels[r] != -100).sum() == (row_want != -100).sum()


def test_rows_as_lists_numpy_or_tensors():
    collate = CompletionCollator(markers=MARKERS, pad_token_id=0)
    want = collate([{"input_ids": r} for r in ROWS])
    for convert in (lambda r: np.asarray(r, dtype=np.int32), lambda r: torch.tensor(r, dtype=torch.int64)):
        got = collate([{"input_ids": convert(r)} for r in ROWS])
        for key in want:
            torch.testing.assert_close(got[key], want[key])


def test_row_labels_keep_and_rebuild():
    examples = [{"input_ids": ROWS[1], "labels": list(ROWS[1])}]  # what TRL's preparation writes
    rebuilt = CompletionCollator(markers=MARKERS, pad_token_id=0)(examples)["labels"].numpy()[0]
    np.testing.assert_array_equal(rebuilt, engine_labels(ROWS[1:2])[0])
    kept = CompletionCollator(markers=MARKERS, pad_token_id=0, row_labels="keep")(examples)["labels"].numpy()[0]
    np.testing.assert_array_equal(kept[1:], ROWS[1][1:])
    assert kept[0] == -100


def test_errors_say_what_to_pass():
    with pytest.raises(ValueError, match="padding_side='up'"):
        CompletionCollator(markers=MARKERS, pad_token_id=0, padding_side="up")
    with pytest.raises(ValueError, match="pad_token_id=-1"):
        CompletionCollator(markers=MARKERS, pad_token_id=-1)
    with pytest.raises(ValueError, match="truncation_mode='middle'"):
        CompletionCollator(markers=MARKERS, truncation_mode="middle")
    with pytest.raises(ValueError, match="prompt_loss_weight=2"):
        CompletionCollator(markers=MARKERS, pad_token_id=0, prompt_loss_weight=2)
    with pytest.raises(TypeError, match="lossmask.Markers"):
        CompletionCollator(markers={"response": [[1]]}, pad_token_id=0)
    collate = CompletionCollator(markers=MARKERS, pad_token_id=0)
    with pytest.raises(ValueError, match="seq_lengths add up to 3 but the row has 4"):
        collate([{"input_ids": [1, 2, 3, 4], "seq_lengths": [1, 2]}])
    with pytest.raises(ValueError, match="negative length"):
        collate([{"input_ids": [1, 2, 3, 4], "seq_lengths": [5, -1]}])
    with pytest.raises(ValueError, match="row 1 holds the negative token id -100 at position 1"):
        collate([{"input_ids": [1, 2]}, {"input_ids": [1, -100]}])
    with pytest.raises(TypeError, match="input_ids"):
        collate([{"text": "hi"}])


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
@pytest.mark.parametrize("padding_free", [False, True])
def test_rows_truncated_after_packing_cut_their_seq_lengths(mode, padding_free):
    """SFTConfig(max_length) shorter than rows packed beforehand: TRL cuts input_ids, not seq_lengths."""
    docs = [ROWS[1], ROWS[0], ROWS[1]]
    packed = [t for d in docs for t in d]
    n = len(ROWS[1]) + 20  # the cut falls inside the middle document; one document is cut away entirely
    lo = 0 if mode == "keep_start" else len(packed) - n
    kept, cut, start = packed[lo : lo + n], [], 0
    for d in docs:  # the pieces of each document inside the kept window
        piece = d[max(0, lo - start) : max(0, lo + n - start)]
        cut += [piece] if piece else []
        start += len(d)
    assert sum(map(len, cut)) == n and len(cut) == 2
    examples = [{"input_ids": kept, "seq_lengths": [len(d) for d in docs]}, {"input_ids": ROWS[1], "seq_lengths": [len(ROWS[1])]}]
    batch = CompletionCollator(markers=MARKERS, pad_token_id=0, padding_free=padding_free, truncation_mode=mode)(examples)
    want = np.concatenate([np.concatenate([[-100], lab[1:]]) for lab in engine_labels(cut)])
    got = batch["labels"][0].numpy()[:n]
    np.testing.assert_array_equal(got, want)  # each kept piece labelled on its own, its first token masked
    if padding_free:
        assert batch["position_ids"][0, :n].tolist() == [i for d in cut for i in range(len(d))]


def test_tokenizer_without_a_pad_token():
    """Llama 3.1 has no pad token: the collator takes the tokenizer (EOS pads, as in TRL) or pads by position anyway."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path("llama-3.1"))
    assert tok.pad_token_id is None
    markers = lossmask.detect_markers(tok)
    convs = [[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend."}],
             [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10 11 12"}]]
    rows = [tok.apply_chat_template(c, return_dict=False) for c in convs]
    for collator in (CompletionCollator(markers=markers, tokenizer=tok),
                     CompletionCollator(markers=markers, pad_token_id=tok.pad_token_id)):
        batch = collator([{"input_ids": r} for r in rows])
        for r, row in enumerate(rows):
            labels = batch["labels"][r].numpy()
            np.testing.assert_array_equal(labels[: len(row)], engine_labels_for(markers, row))
            assert (labels[len(row):] == -100).all() and batch["attention_mask"][r, len(row):].sum() == 0
    assert CompletionCollator(markers=markers, tokenizer=tok).pad_token_id == tok.eos_token_id
    assert CompletionCollator(markers=markers, pad_token_id=tok.pad_token_id).pad_token_id == 0
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    short = CompletionCollator(markers=markers, pad_token_id=eot)([{"input_ids": r} for r in rows])
    assert short["labels"][0, len(rows[0]) - 1].item() == eot  # the real end of turn trains although pad == it


def engine_labels_for(markers, row):
    labels = np.asarray(lossmask.make_labels([row], markers)[0], dtype=np.int64)
    labels[0] = -100
    return labels


def test_prompt_weighted_loss():
    torch.manual_seed(0)
    rows = [r for r in ROWS if r]
    logits = torch.randn(len(rows), max(map(len, rows)), 40)
    plain = CompletionCollator(markers=MARKERS, pad_token_id=0)([{"input_ids": r} for r in rows])
    zero = CompletionCollator(markers=MARKERS, pad_token_id=0, prompt_loss_weight=1e-9)([{"input_ids": r} for r in rows])
    usual = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), plain["labels"][:, 1:].reshape(-1))
    torch.testing.assert_close(prompt_weighted_loss(logits, zero["input_ids"], zero["loss_weights"]), usual, rtol=1e-6, atol=1e-6)
    w = 0.25
    weighted = CompletionCollator(markers=MARKERS, pad_token_id=0, prompt_loss_weight=w)([{"input_ids": r} for r in rows])
    weights = weighted["loss_weights"]
    attn = weighted["attention_mask"].bool()
    assert set(weights[attn & (weighted["labels"] == -100)][1:].tolist()) <= {w, 0.0}
    assert (weights[~attn] == 0).all() and (weights[weighted["labels"] != -100] == 1).all()
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 40), weighted["input_ids"][:, 1:].reshape(-1), reduction="none")
    flat_w = weights[:, 1:].reshape(-1)
    torch.testing.assert_close(prompt_weighted_loss(logits, weighted["input_ids"], weights), (ce * flat_w).sum() / flat_w.sum())


def _tiny_llama(vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config)


def _chats(tok):
    convs = [
        [{"role": "user", "content": f"What is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."},
         {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"It is {2 * (a + b)}."}]
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (9, 9)]
    ]
    return [tok.apply_chat_template(c, return_dict=False) for c in convs]


@pytest.mark.parametrize("prompt_loss_weight", [0.0, 0.5])
def test_sft_trainer_steps_and_loss_counts_trained_tokens(tmp_path, prompt_loss_weight):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))
    markers = lossmask.detect_markers(tok)
    rows = _chats(tok)
    seen = []

    class Recording(PromptWeightedLossMixin, SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, num_items_in_batch))
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    collator = CompletionCollator(markers=markers, pad_token_id=tok.pad_token_id, prompt_loss_weight=prompt_loss_weight)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                     disable_tqdm=True)
    model = _tiny_llama(len(tok))
    trainer = Recording(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
                        processing_class=tok, data_collator=collator)
    trainer.train()
    assert len(seen) == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 3 and all(np.isfinite(losses))

    inputs, num_items = seen[-1]
    ids, labels = inputs["input_ids"], inputs["labels"]
    lengths = inputs["attention_mask"].sum(1)
    want = lossmask.label_batch([ids[r, : lengths[r]].tolist() for r in range(len(ids))], markers)
    n_trained = int(want.trained_tokens.sum())
    assert n_trained > 0 and int((labels != -100).sum()) == n_trained
    for r, row in enumerate(want.labels):
        assert labels[r, : lengths[r]].tolist() == row
    if prompt_loss_weight == 0:
        assert int(num_items) == n_trained  # transformers normalises by exactly the trained tokens
    # the loss is the mean over exactly the trained tokens (or the weighted mean with prompt tokens)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=inputs["attention_mask"]).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    trained = (labels[:, 1:] != -100).reshape(-1)
    if prompt_loss_weight == 0:
        torch.testing.assert_close(model(input_ids=ids, attention_mask=inputs["attention_mask"], labels=labels).loss,
                                   ce[trained].mean())
    else:
        real = inputs["attention_mask"][:, 1:].reshape(-1).bool()
        weights = torch.where(trained, 1.0, torch.where(real, prompt_loss_weight, 0.0))
        torch.testing.assert_close(prompt_weighted_loss(logits, ids, inputs["loss_weights"]), (ce * weights).sum() / weights.sum())


@pytest.mark.parametrize("max_length", [None, 64])
def test_sft_trainer_with_trl_packed_rows_padding_free(tmp_path, max_length):
    """TRL refuses a custom collator with its own padding-free packing; rows packed beforehand with
    trl's pack_dataset (bfd) go through this collator's padding-free mode, one label pass per sequence.
    With SFTConfig(max_length) shorter than the packs, TRL cuts input_ids but not seq_lengths: the
    collator cuts seq_lengths the same way."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import pack_dataset

    tok = AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))
    markers = lossmask.detect_markers(tok)
    packed = pack_dataset(Dataset.from_dict({"input_ids": _chats(tok)}), 128, "bfd")
    seen = []

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, num_items_in_batch))
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, max_length=max_length,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Recording(model=_tiny_llama(len(tok)), args=args, train_dataset=packed, processing_class=tok,
                        data_collator=CompletionCollator(markers=markers, pad_token_id=tok.pad_token_id, padding_free=True))
    trainer.train()
    inputs, num_items = seen[-1]
    if max_length is not None:
        assert max(len(r) for r in trainer.train_dataset["input_ids"]) == max_length
        assert any(sum(s) > max_length for s in trainer.train_dataset["seq_lengths"])  # TRL left them uncut
        assert inputs["input_ids"].shape[1] <= 2 * max_length
    cu = inputs["cu_seq_lens_q"].tolist()
    ids = inputs["input_ids"][0].tolist()
    want = lossmask.label_batch([ids[a:b] for a, b in zip(cu[:-1], cu[1:])], markers)
    assert inputs["labels"][0].tolist() == [t for row in want.labels for t in row]
    assert int(num_items) == int(want.trained_tokens.sum()) > 0
    assert len(cu) > 2  # several sequences in the packed row, each labelled on its own
