"""``lossmask lora``: mlx-lm's training from a YAML config on an mlx-lm data folder (or `lossmask mask`
output), with a tiny model saved in the test, and the loss over exactly the trained tokens."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest

import lossmask

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
yaml = pytest.importorskip("yaml")

from lossmask import cli, lora  # noqa: E402

from conftest import tokenizer_path  # noqa: E402
from test_mlx_feed import chat_rows, write  # noqa: E402

NO_ASSISTANT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path("lfm2"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    """A tiny Llama saved as mlx-lm saves models, with the lfm2 tokenizer: what `--model` points at."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    folder = tmp_path_factory.mktemp("tiny-model")
    config = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": len(tok),
              "tie_word_embeddings": False}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_path("lfm2") / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write(folder, "train", chat_rows(4, vary=False) + [NO_ASSISTANT])  # the last row trains nothing
    write(folder, "valid", chat_rows(4))
    write(folder, "test", chat_rows(4))
    return folder


class Recorder:
    def __init__(self):
        self.train, self.val = [], []

    def on_train_loss_report(self, info):
        self.train.append(info)

    def on_val_loss_report(self, info):
        self.val.append(info)


def hand_loss(model_dir, tok, rows):
    """Mean next-token cross-entropy over the trained tokens, row by row (no batch, no padding), in NumPy."""
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    markers = lossmask.detect_markers(tok)
    total, count = 0.0, 0
    for row in rows:
        ids = tok.apply_chat_template(row["messages"], tools=row.get("tools"), return_dict=False)
        labels = np.asarray(lossmask.make_labels([ids], markers)[0])
        assert (np.asarray(ids)[labels != -100] == 7).sum() == 2  # both assistant turns train, through <|im_end|>
        logits = np.array(model(mx.array([ids[:-1]]))[0].astype(mx.float32), dtype=np.float64)
        top = logits.max(-1, keepdims=True)
        logz = (top[:, 0] + np.log(np.exp(logits - top).sum(-1)))
        nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
        trained = labels[1:] != -100
        total += float(nll[trained].sum())
        count += int(trained.sum())
    return total / count, count


def config_file(tmp_path, model_dir, data_dir, **extra):
    config = {"model": str(model_dir), "train": True, "data": str(data_dir), "fine_tune_type": "lora", "num_layers": 2,
              "batch_size": 4, "iters": 2, "val_batches": -1, "steps_per_report": 1, "steps_per_eval": 100,
              "learning_rate": 1e-3, "adapter_path": str(tmp_path / "adapters"), "seed": 0,
              "lora_parameters": {"rank": 4, "dropout": 0.0, "scale": 10.0}, **extra}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_lossmask_lora_from_a_yaml_config(tmp_path, model_dir, data_dir, tok, capsys):
    path = config_file(tmp_path, model_dir, data_dir, test=True)
    assert cli.main(["lora", "-c", str(path)]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    # mlx-lm's progress, then lossmask's report of each split (reasons by name, as `lossmask mask` prints them)
    assert "Loading pretrained model" in text and "Training" in text and "Test loss" in text
    assert f"lossmask: {data_dir / 'train.jsonl'}" in text
    assert "rows in: 5   rows out: 4   dropped: 1 (20.0%)" in text
    assert "dropped by reason: no_response 1" in text
    assert "markers (detected)" in text
    assert (tmp_path / "adapters" / "adapters.safetensors").is_file()
    saved = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert saved["fine_tune_type"] == "lora" and saved["max_drop_fraction"] == 0.3
    from mlx_lm.utils import load

    load(str(model_dir), adapter_path=str(tmp_path / "adapters"))  # mlx-lm reads the adapters back (generate, fuse)


@pytest.mark.parametrize("fine_tune_type", ["lora", "full"])
def test_step_one_loss_is_cross_entropy_over_the_trained_tokens(tmp_path, model_dir, data_dir, tok, fine_tune_type):
    recorder = Recorder()
    path = config_file(tmp_path, model_dir, data_dir)
    # flags override the YAML file, as with mlx_lm lora
    assert lora.main(["-c", str(path), "--fine-tune-type", fine_tune_type, "--iters", "1"], training_callback=recorder) == 0
    want_train, n_train = hand_loss(model_dir, tok, chat_rows(4, vary=False))
    want_val, _ = hand_loss(model_dir, tok, chat_rows(4))
    # one batch of all four trained rows: step 1's loss is over exactly their trained tokens
    assert recorder.train[0]["iteration"] == 1 and recorder.train[0]["trained_tokens"] == n_train
    assert recorder.train[0]["train_loss"] == pytest.approx(want_train, rel=1e-6)
    assert recorder.val[0]["val_loss"] == pytest.approx(want_val, rel=1e-6)  # validation before the first step


def test_lossmask_mask_output_trains_the_same(tmp_path, model_dir, data_dir, tok, capsys):
    masked = tmp_path / "masked"
    masked.mkdir()
    for split in ("train", "valid"):
        lossmask.mask_files(data_dir / f"{split}.jsonl", masked / f"{split}.parquet", tokenizer=tok)
    recorder = Recorder()
    path = config_file(tmp_path, model_dir, data_dir)
    assert lora.main(["-c", str(path), "--data", str(masked), "--iters", "1"], training_callback=recorder) == 0
    assert f"lossmask: {masked / 'train.parquet'}" in capsys.readouterr().out
    want_train, n_train = hand_loss(model_dir, tok, chat_rows(4, vary=False))
    assert recorder.train[0]["trained_tokens"] == n_train
    assert recorder.train[0]["train_loss"] == pytest.approx(want_train, rel=1e-6)


def test_errors_name_the_setting(tmp_path, model_dir, data_dir, capsys):
    path = config_file(tmp_path, model_dir, data_dir, train=False)
    formatwarning = warnings.formatwarning
    assert lora.main(["-c", str(path)]) == 1
    assert warnings.formatwarning is formatwarning  # called from Python, the command leaves the warning format as it was
    assert "pass --train" in capsys.readouterr().err
    assert lora.main(["-c", str(path), "--train", "--data", "mlx-community/WikiSQL"]) == 1
    assert "not a local folder" in capsys.readouterr().err
    assert lora.main(["-c", str(path), "--train", "--max-drop-fraction", "0.1"]) == 1
    assert "train.jsonl: 1 of 5 rows" in capsys.readouterr().err  # the safety net, per split


def test_parser_is_mlx_lm_s_own():
    from mlx_lm import lora as mlx_lora

    ours = {a.dest for a in lora.build_parser()._actions}
    theirs = {a.dest for a in mlx_lora.build_parser()._actions}
    assert theirs <= ours
    args = lora.parse_args(["--model", "m", "--data", "d", "--train"])
    assert args.batch_size == mlx_lora.CONFIG_DEFAULTS["batch_size"] and args.max_drop_fraction == 0.3


@pytest.mark.parametrize("per_sequence", [False, True])
def test_loss_weights_column_weights_the_loss(tmp_path, model_dir, data_dir, tok, capsys, per_sequence):
    """A split with loss_weights: step 1's loss is the hand-computed weighted cross-entropy."""
    from mlx_lm.utils import load

    from test_mlx_feed import hand_weighted_ce, weighted_split

    markers = lossmask.detect_markers(tok)
    masked = tmp_path / "weighted"
    masked.mkdir()
    ids, weights = weighted_split(tok, markers, data_dir / "train.jsonl", masked / "train.parquet")
    val_ids, val_weights = weighted_split(tok, markers, data_dir / "valid.jsonl", masked / "valid.parquet")
    recorder = Recorder()
    path = config_file(tmp_path, model_dir, data_dir)
    argv = ["-c", str(path), "--data", str(masked), "--iters", "1"] + (["--per-sequence-loss"] if per_sequence else [])
    assert lora.main(argv, training_callback=recorder) == 0
    assert "the loss is sum(w * nll) / sum(w)" in capsys.readouterr().out
    model, _ = load(str(model_dir))
    want, n = hand_weighted_ce(model, ids, weights, per_sequence=per_sequence)
    assert recorder.train[0]["train_loss"] == pytest.approx(want, rel=1e-6)
    assert recorder.train[0]["trained_tokens"] == pytest.approx(n, rel=1e-6)  # the weight sum (rows, per sequence)
    want_val, _ = hand_weighted_ce(model, val_ids, val_weights, per_sequence=per_sequence)
    assert recorder.val[0]["val_loss"] == pytest.approx(want_val, rel=1e-6)
