"""``lossmask lora``: mlx-lm's LoRA / DoRA / full fine-tuning (``mlx_lm lora``) trained on lossmask's masks.

The command line, the YAML file (``-c lora.yaml``), the model loading, the adapter files, the
optimizers and the progress lines are mlx-lm's own: this module builds mlx-lm's parser and adds a few
flags, merges the YAML file as ``mlx_lm lora`` does, loads the model with ``mlx_lm.load`` and calls
``mlx_lm.tuner.trainer.train`` / ``evaluate``. Only the data path differs, through the hooks that
``train`` takes: the splits come from ``lossmask.mlx.load_dataset`` (mlx-lm JSONL or ``lossmask mask``
Parquet), batches from ``lossmask.mlx.iterate_batches`` and the loss from ``lossmask.mlx.make_loss``,
so every assistant turn trains and nothing else does. Each split's drop report is printed as
``lossmask mask`` prints it.

A split with a ``loss_weights`` column (``lossmask mask`` Parquet, or its columns as JSONL rows)
trains each token with its own weight: the loss is sum(w * nll) / sum(w) (``--per-sequence-loss``:
the mean of each row's weighted mean), and mlx-lm's "trained tokens" count is then the weight sum.

Differences from ``mlx_lm lora`` (besides the masks): prompts are always masked, so ``mask_prompt``
changes nothing (``--last-turn-only`` trains only the last assistant turn, which is what mlx-lm's
``--mask-prompt`` trains); text rows train every token; ``--data`` must be a local folder.

Importing this module imports neither MLX nor mlx-lm; ``main`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import Any, Sequence

from .options import DEFAULT_MAX_DROP_FRACTION

# lossmask's own settings, on the command line or in the YAML file (with underscores), and their defaults
DEFAULTS = {"markers": None, "last_turn_only": False, "prompt_loss_weight": 0.0, "per_sequence_loss": False,
            "max_drop_fraction": DEFAULT_MAX_DROP_FRACTION}


def _mlx_lm_lora():
    try:
        from mlx_lm import lora
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"lossmask lora runs mlx-lm, which is not importable ({exc}); pip install 'lossmask[mlx]'") from None
    return lora


def build_parser() -> argparse.ArgumentParser:
    """mlx-lm's ``lora`` parser (every flag it has, same names and meaning) plus lossmask's flags."""
    parser = _mlx_lm_lora().build_parser()
    parser.prog = "lossmask lora"
    parser.description = (
        "mlx-lm's LoRA / DoRA / full fine-tuning with lossmask's masks: every assistant turn trains, nothing else. "
        "Same flags and YAML file as `mlx_lm lora`; --data is a folder of train/valid/test .jsonl (mlx-lm's formats) "
        "or .parquet (`lossmask mask` output)."
    )
    group = parser.add_argument_group("lossmask")
    group.add_argument("--markers", metavar="FILE.json", help="Markers JSON (default: derived from the model's chat template)")
    group.add_argument("--last-turn-only", action="store_true", default=None,
                       help="train only the last assistant turn of each row (what mlx-lm's --mask-prompt trains)")
    group.add_argument("--prompt-loss-weight", type=float, metavar="W",
                       help="weight of the other real tokens in the loss (default 0: only assistant turns count); "
                            "a split with a loss_weights column uses its own weights instead")
    group.add_argument("--per-sequence-loss", action="store_true", default=None,
                       help="average each row's (weighted) mean loss over the rows, instead of over all trained tokens")
    group.add_argument("--max-drop-fraction", type=float, metavar="F",
                       help=f"stop when more than F of a split's rows train nothing (default {DEFAULT_MAX_DROP_FRACTION})")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> types.SimpleNamespace:
    """The settings of a run, merged as ``mlx_lm lora`` merges them: command line, then the YAML file, then defaults."""
    mlx_lora = _mlx_lm_lora()
    args = vars(build_parser().parse_args(argv))
    if args.get("config"):
        import yaml

        with open(args["config"], encoding="utf-8") as fh:
            config = yaml.load(fh, mlx_lora.yaml_loader) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{args['config']} holds a {type(config).__name__}; a config file is a YAML mapping of options")
        for key, value in config.items():
            if args.get(key) is None:
                args[key] = value
    for key, value in {**mlx_lora.CONFIG_DEFAULTS, **DEFAULTS}.items():
        if args.get(key) is None:
            args[key] = value
    return types.SimpleNamespace(**args)


def main(argv: Sequence[str] | None = None, *, training_callback: Any = None) -> int:
    """``lossmask lora ...``; returns the exit status. ``training_callback``: an mlx-lm ``TrainingCallback``."""
    from .jobs.display import MAX_ERROR_LINE, one_line, warnings_on_one_line

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    with warnings_on_one_line("lossmask lora"):
        try:
            run(parse_args(argv), training_callback=training_callback)
        except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
            text = "\n".join(one_line(line, MAX_ERROR_LINE) for line in str(exc).split("\n"))  # escaped, bounded
            print(f"lossmask lora: error: {text}", file=sys.stderr)
            return 1
    return 0


def run(args: types.SimpleNamespace, *, training_callback: Any = None) -> None:
    """Load the model and the masked splits, then train and / or test, as ``mlx_lm lora`` does."""
    import numpy as np
    from mlx_lm.tuner.callbacks import get_reporting_callbacks
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load

    from . import mlx as lm

    if not args.train and not args.test:
        raise ValueError("pass --train (and / or --test), or set train: true in the config file")
    if getattr(args, "hf_dataset", None) or not Path(args.data).is_dir():
        raise ValueError(f"data={args.data!r} is not a local folder; lossmask lora reads a folder of train/valid/test "
                         ".jsonl (or .parquet from `lossmask mask`), not a Hugging Face dataset name")
    np.random.seed(args.seed)  # the batch order, as in mlx-lm
    if training_callback is None:
        training_callback = get_reporting_callbacks(args.report_to, project_name=args.project_name,
                                                    log_dir=args.adapter_path, config=vars(args))
    print("Loading pretrained model", flush=True)
    model, tokenizer = load(args.model, tokenizer_config={"trust_remote_code": args.trust_remote_code},
                            trust_remote_code=args.trust_remote_code)
    print("Loading datasets", flush=True)
    train_set, valid_set, test_set = load_splits(args, tokenizer)
    if args.test and not test_set:
        raise ValueError(f"--test needs a test split: {args.data} has no test.jsonl (or test.parquet)")
    loss = lm.make_loss(prompt_loss_weight=args.prompt_loss_weight, per_sequence=bool(args.per_sequence_loss))
    if args.train:
        print("Training", flush=True)
        train_model(args, model, train_set, valid_set, loss=loss, training_callback=training_callback)
    elif args.adapter_path != "":  # testing without training: the adapters of an earlier run
        load_adapters(model, args.adapter_path)
    if args.test:
        print("Testing", flush=True)
        evaluate_model(args, model, test_set, loss=loss)


def load_splits(args: types.SimpleNamespace, tokenizer: Any) -> tuple:
    """The masked splits of ``args.data``, each split's drop report printed."""
    from . import mlx as lm
    from .jobs.report import MaskReport, Tally
    from .jobs.stream import load_chat_tokenizer, resolve_job_markers

    chat = load_chat_tokenizer(tokenizer)
    markers, source, messages = resolve_job_markers(args.markers, tokenizer=chat, model_name=str(args.model), strict=False)
    for message in messages:
        print(f"lossmask: {message}", flush=True)
    text_rows = _first_row_shape(Path(args.data), args) == "text"
    if text_rows:
        print("lossmask: text rows have no turns to mask: every token trains", flush=True)
    elif markers is None:
        print("lossmask: no markers for this chat template: every token trains", flush=True)
    if args.mask_prompt:
        print("lossmask: mask_prompt changes nothing here (prompts are always masked; every assistant turn trains); "
              "--last-turn-only trains only the last one", flush=True)
    splits = lm.load_dataset(
        args.data, chat, markers=markers, mask_prompt=markers is not None and not text_rows,
        last_turn_only=args.last_turn_only, max_drop_fraction=args.max_drop_fraction,
        prompt_feature=getattr(args, "prompt_feature", "prompt"), completion_feature=getattr(args, "completion_feature", "completion"),
        chat_feature=getattr(args, "chat_feature", "messages"), text_feature=getattr(args, "text_feature", "text"),
    )
    for split in splits:
        if isinstance(split, lm.MaskedDataset):
            masked = split.mask_prompt or split.trained_values is not None
            report = MaskReport.build(Tally(counts=split.counts, rows_out=len(split)), markers=markers if masked else None,
                                      markers_source=source if masked else "none", keep_dropped=False, input=split.name)
            lines = report.summary().splitlines()
            if split is not splits[0]:  # the markers once, with the train split
                lines = [line for line in lines if not line.startswith("markers")]
            if split.weight_values is not None:
                lines.append(f"loss weights: the split's loss_weights column (weight sum {float(split.weight_values.sum()):g}); "
                             "the loss is sum(w * nll) / sum(w)")
                if args.prompt_loss_weight:
                    lines.append("prompt_loss_weight changes nothing on this split: its loss_weights say each token's weight")
            print(f"lossmask: {split.name}\n  " + "\n  ".join(lines), flush=True)
    return splits


def _first_row_shape(folder: Path, args: types.SimpleNamespace) -> str | None:
    """The row shape of the train split's first JSONL row (None for Parquet or a missing file)."""
    from .mlx import Features, split_file

    path = split_file(folder, "train")
    if path is None or path.suffix != ".jsonl":
        return None
    features = Features(prompt=getattr(args, "prompt_feature", "prompt"), completion=getattr(args, "completion_feature", "completion"),
                        chat=getattr(args, "chat_feature", "messages"), text=getattr(args, "text_feature", "text"))
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    return features.shape_of(json.loads(line))
                except json.JSONDecodeError:
                    return None  # load_dataset names the bad line
    return None


def train_model(args: types.SimpleNamespace, model: Any, train_set: Any, valid_set: Any, *, loss: Any,
                training_callback: Any = None) -> None:
    """``mlx_lm lora``'s training step by step (layers, adapters, optimizer), with lossmask's batches and loss."""
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import TrainingArgs, train
    from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers, print_trainable_parameters
    from mlx_lm.utils import save_config

    from . import mlx as lm

    mx.random.seed(args.seed)
    model.freeze()
    if args.num_layers > len(model.layers):
        raise ValueError(f"num_layers={args.num_layers} but the model has {len(model.layers)} layers; pass at most that, "
                         "or -1 for all")
    if args.fine_tune_type == "full":
        for layer in model.layers[-max(args.num_layers, 0):]:
            layer.unfreeze()
        args.lora_parameters = None
    elif args.fine_tune_type in ("lora", "dora"):
        linear_to_lora_layers(model, args.num_layers, args.lora_parameters, use_dora=args.fine_tune_type == "dora")
    else:
        raise ValueError(f"fine_tune_type={args.fine_tune_type!r}; pass lora, dora or full")
    if args.resume_adapter_file is not None:
        print(f"Loading fine-tuned weights from {args.resume_adapter_file}", flush=True)
        model.load_weights(args.resume_adapter_file, strict=False)
    _print_header(args)
    print_trainable_parameters(model)
    adapter_path = Path(args.adapter_path)
    adapter_path.mkdir(parents=True, exist_ok=True)
    save_config(dict(vars(args)), adapter_path / "adapter_config.json")
    optimizers = {"adam": optim.Adam, "adamw": optim.AdamW, "sgd": optim.SGD, "adafactor": optim.Adafactor}
    if hasattr(optim, "Muon"):
        optimizers["muon"] = optim.Muon
    name = str(args.optimizer).lower()
    if name not in optimizers:
        raise ValueError(f"optimizer={args.optimizer!r}; pass one of {', '.join(optimizers)}")
    learning_rate = build_schedule(args.lr_schedule) if args.lr_schedule else args.learning_rate
    optimizer = optimizers[name](learning_rate=learning_rate, **(args.optimizer_config or {}).get(name, {}))
    training_args = TrainingArgs(
        batch_size=args.batch_size, iters=args.iters, val_batches=args.val_batches, steps_per_report=args.steps_per_report,
        steps_per_eval=args.steps_per_eval, steps_per_save=args.save_every, adapter_file=adapter_path / "adapters.safetensors",
        max_seq_length=args.max_seq_length, grad_checkpoint=args.grad_checkpoint,
        grad_accumulation_steps=args.grad_accumulation_steps, clear_cache_threshold=args.clear_cache_threshold,
    )
    train(model=model, optimizer=optimizer, train_dataset=train_set, val_dataset=valid_set or None, args=training_args,
          loss=loss, iterate_batches=lm.iterate_batches, training_callback=training_callback)


def evaluate_model(args: types.SimpleNamespace, model: Any, test_set: Any, *, loss: Any) -> float:
    """The test loss over trained tokens, printed as ``mlx_lm lora --test`` prints it."""
    from mlx_lm.tuner.trainer import evaluate

    from . import mlx as lm

    test_loss = evaluate(model=model, dataset=test_set, batch_size=args.batch_size, num_batches=args.test_batches,
                         max_seq_length=args.max_seq_length, loss=loss, iterate_batches=lm.iterate_batches)
    print(f"Test loss {test_loss:.3f}, Test ppl {math.exp(test_loss):.3f}.", flush=True)
    return test_loss


def _print_header(args: types.SimpleNamespace) -> None:
    try:
        import mlx.core as mx
        from mlx_lm.cli_ui import make_console, print_lora_run_header
    except ImportError:  # older mlx-lm: no header panel
        return
    if mx.distributed.init().rank() == 0:
        print_lora_run_header(make_console(), args)
