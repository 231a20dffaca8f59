"""End to end: the weights ``lossmask`` writes (from the fields a dataset carries) are the weights the
losses use. OpenAI-style ``weight`` on assistant messages plus a prompt weight, labelled by ``hf.mask_dataset`` /
``mask_files``, then trained on by the TRL collator + ``WeightedLoss`` and by the mlx-lm feed + ``make_loss``: each loss
equals a cross-entropy computed by hand from the rows' own weights, to 1e-6."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lossmask

from conftest import tokenizer_path

PROMPT_WEIGHT = 0.05


def openai_rows(n=4):
    """Chats as OpenAI's fine-tuning format writes them: the first reply opted out (``weight: 0``)."""
    return [{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"Let me think about {i}.", "weight": 0},
        {"role": "user", "content": "And the answer?"},
        {"role": "assistant", "content": f"It is {2 * i}.", "weight": 1},
    ]} for i in range(n)]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))


def _check_weights(tok, row):
    """What the rule gives, read off the row itself: the opted-out reply weighs 0, the other one 1, the rest the
    prompt weight; labels train exactly where the weight is positive."""
    ids, labels, weights = row["input_ids"], row["labels"], np.asarray(row["loss_weights"])
    assert set(np.round(weights, 6)) <= {0.0, PROMPT_WEIGHT, 1.0}
    assert [t for t, w in zip(ids, weights) if w > 0] == [t for t in labels if t != -100]
    text = {w: tok.decode([t for t, x in zip(ids, weights) if np.isclose(x, w)]) for w in (0.0, 1.0)}
    assert text[1.0].startswith("It is ") and text[1.0].endswith("<|im_end|>")  # the kept reply, its stop token
    assert text[0.0].startswith("Let me think about ") and text[0.0].endswith("<|im_end|>")  # the opted-out one


def test_trl_collator_and_weighted_loss_train_on_the_weights_lossmask_wrote(tok):
    torch = pytest.importorskip("torch")
    datasets = pytest.importorskip("datasets")
    from lossmask import hf
    from lossmask.collator import CompletionCollator, WeightedLoss

    from test_collator import _tiny_llama
    from test_weighted_loss import hand_loss

    labelled = hf.mask_dataset(datasets.Dataset.from_list(openai_rows()), tok, prompt_weight=PROMPT_WEIGHT, quiet=True)
    rows = [{k: r[k] for k in ("input_ids", "labels", "loss_weights")} for r in labelled]
    for row in rows:
        _check_weights(tok, row)
    model = _tiny_llama(len(tok)).eval()
    batch = CompletionCollator(markers=lossmask.detect_markers(tok), tokenizer=tok)(rows)
    loss = WeightedLoss().attach(model)
    labels = batch.pop("labels")
    with torch.no_grad():
        got = loss(model(**batch), labels)
        logits = [model(input_ids=torch.tensor([r["input_ids"]])).logits[0].numpy() for r in rows]
    want = hand_loss(logits, [r["input_ids"] for r in rows], [r["loss_weights"] for r in rows])
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_mlx_feed_and_make_loss_train_on_the_weights_lossmask_wrote(tmp_path, tok):
    pytest.importorskip("mlx.core")
    import pyarrow.parquet as pq

    from lossmask import mlx as lm

    from test_mlx_feed import _tiny_model, hand_weighted_ce

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in openai_rows()))
    (tmp_path / "masked").mkdir()
    lossmask.mask_files(tmp_path / "data" / "train.jsonl", tmp_path / "masked" / "train.parquet", tokenizer=tok,
                        prompt_weight=PROMPT_WEIGHT, progress=False)
    rows = pq.read_table(tmp_path / "masked" / "train.parquet").to_pylist()
    for row in rows:
        _check_weights(tok, row)
    train, _, _ = lm.load_dataset(tmp_path / "masked", tok)
    batch = next(lm.iterate_batches(train, len(rows), 2048, seed=0))
    model = _tiny_model(len(tok))
    loss, n = lm.make_loss()(model, *batch)
    # iterate_batches sorts rows by length: the hand CE is over the same rows, in any order
    want, mass = hand_weighted_ce(model, [r["input_ids"] for r in rows], [r["loss_weights"] for r in rows])
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert float(n) == pytest.approx(mass, rel=1e-6)
