"""The engine on every real tokenizer with its detected markers, as a ratio to np.copyto of the same tokens.

For each family in the shared tokenizers folder (``$LOSSMASK_TOKENIZERS``, default
``../shared/tokenizers``; families absent are skipped): ``detect_markers`` on its tokenizer, a few
hundred chats rendered by its own chat template and tokenised (multi-turn, system prompts where the
template takes them, a tool call where it renders one, and content full of newlines, indented code,
lists, tabs and leading/trailing spaces), then those rows tiled up to about 20 M tokens so that the
engine, not rendering, is timed. Per family: ``make_labels`` (int64 labels) with 2 threads and with 1
(``numba.set_num_threads``), and ``last_turn_only`` with 2, each as Mtok/s and as a ratio to
``np.copyto`` int32 -> int64 of the same tokens in the same run, and the kernel alone writing into a
warm buffer (what ``make_labels`` adds: checks, an output from Arrow's pool, Arrow assembly). One more
row is the idealised case: three ChatML patterns on synthetic rows (``conftest.chatml_rows``). The
machine (CPU model, cores, numba threads) heads the output, and a second table sets ``make_labels``
beside the yardsticks of a fresh output: Arrow's cast to list<int64> and NumPy's ``astype``.

``--content third-party`` fills the messages with pieces of text nobody here wrote instead (the
installed packages' READMEs and the standard library's modules, ``third_party_chunks``).

Detected markers and rendered rows are cached in ``.benchmarks/engine-rows/`` (keyed by the
tokenizer files and the detection code), so a second run only times.

Run: ``python benchmarks/bench_engine.py --table`` (a Markdown table, about 1 minute once cached;
``--cpu-time`` times one thread by its CPU time, steadier on a loaded machine; name families to run
only those), or ``make bench`` (pytest-benchmark, one test per family).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lossmask  # noqa: E402
from lossmask.engine.patterns import KINDS  # noqa: E402
from lossmask.markers.cache import code_digest  # noqa: E402
from conftest import CHATML, chatml_rows, copy_baseline_seconds  # noqa: E402

REPO = HERE.parent
TOKENIZERS_DIR = Path(os.environ.get("LOSSMASK_TOKENIZERS", REPO.parent / "shared" / "tokenizers"))
CACHE_DIR = REPO / ".benchmarks" / "engine-rows"
TARGET_TOKENS = 20_000_000
N_CHATS = 300
REPEAT = 15
IDEALISED = "chatml (idealised: 3 patterns, synthetic rows)"


# -- realistic chats -------------------------------------------------------------------------

_WORDS = (
    "the model reads each token and the loss counts only what the assistant writes so masks matter "
    "data rows arrive in batches with offsets and values we label them once per pass quickly"
).split()


def _content(rng: np.random.Generator, kind: int) -> str:
    """One message body, whitespace-rich the way real chat data is."""
    def sentence() -> str:
        words = rng.choice(_WORDS, size=int(rng.integers(6, 16)))
        return " ".join(words).capitalize() + rng.choice([".", "?", "!", ":"])

    if kind == 0:  # paragraphs
        return "\n\n".join(" ".join(sentence() for _ in range(int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 4))))
    if kind == 1:  # indented code
        body = "\n".join(
            "    " * int(rng.integers(1, 4)) + f"x{k} = {rng.choice(_WORDS)}({k}, {int(rng.integers(100))})"
            for k in range(int(rng.integers(3, 12)))
        )
        return f"{sentence()}\n\n```python\ndef f(a, b):\n{body}\n    return a\n```\n\n{sentence()}"
    if kind == 2:  # lists
        items = "\n".join(
            (f"{k + 1}. " if rng.integers(2) else "- ") + sentence() + ("\n   - " + sentence() if rng.integers(3) == 0 else "")
            for k in range(int(rng.integers(3, 8)))
        )
        return f"{sentence()}\n{items}\n"
    # odd whitespace: leading/trailing spaces and newlines, tabs, blank lines
    pad = ["", " ", "  ", "\n", "\n\n", "\t", " \n"]
    return rng.choice(pad) + "\t".join(sentence() for _ in range(int(rng.integers(1, 3)))) + "\n\n\n" + sentence() + rng.choice(pad)


# What message bodies hold: "generated" (``_content``: whitespace-rich text this file writes) or
# "third-party" (``third_party_chunks``: text nobody here wrote). Set by ``--content``.
CONTENT = "generated"


@functools.lru_cache(maxsize=1)
def third_party_chunks() -> tuple[str, ...]:
    """Pieces of text written by others, found on any machine with this environment: the long descriptions
    of the installed packages (their READMEs: Markdown prose, lists, code blocks) and the Python standard
    library's own modules (code, docstrings, comments), cut at line ends into pieces of about 25 lines."""
    import importlib.metadata
    import sysconfig

    texts = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        body = (dist.read_text("METADATA") or "").partition("\n\n")[2]
        if body.strip():
            texts.append(body)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts += [f.read_text(encoding="utf-8", errors="replace") for f in sorted(stdlib.glob("*.py"))]
    chunks = []
    for text in texts:
        lines = text.splitlines(keepends=True)
        chunks += ["".join(lines[k:k + 25]) for k in range(0, len(lines), 25)]
    return tuple(c for c in chunks if len(c.strip()) >= 80)


def _message(rng: np.random.Generator) -> str:
    if CONTENT == "third-party":
        chunks = third_party_chunks()
        return chunks[int(rng.integers(len(chunks)))]
    return _content(rng, int(rng.integers(4)))


def _chat(rng: np.random.Generator) -> tuple[list[dict], bool, bool]:
    """(messages, has_system, has_tool): 2-6 user/assistant turns, a system prompt half the time."""
    messages = []
    system = bool(rng.integers(2))
    if system:
        messages.append({"role": "system", "content": "You are a careful assistant.\n" + _message(rng)})
    tool = rng.integers(4) == 0
    for turn in range(int(rng.integers(2, 7))):
        messages.append({"role": "user", "content": _message(rng)})
        if tool and turn == 0:
            call = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "minus three, snowing"})
        messages.append({"role": "assistant", "content": _message(rng)})
    return messages, system, bool(tool)


def _render_rows(tok, n_chats: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets int64, values int32)`` of ``n_chats`` chats, each simplified until the template takes it."""
    from lossmask.chat.tokenizer import ChatTemplateError
    from lossmask.chat.probes import WEATHER_TOOL

    rng = np.random.default_rng(seed)
    texts = []
    while len(texts) < n_chats:
        messages, _, tool = _chat(rng)
        no_tool = [m for m in messages if m["role"] != "tool" and not m.get("tool_calls")]
        no_system = [m for m in no_tool if m["role"] != "system"]
        for candidate, tools in ((messages, [WEATHER_TOOL] if tool else None), (no_tool, None), (no_system, None)):
            try:
                texts.append(tok.render(candidate, tools=tools))
                break
            except ChatTemplateError:
                continue
        else:
            raise RuntimeError(f"{tok.name}: the template renders none of the chat's simplifications")
    rows = tok.encode_texts(texts)
    offsets = rows.offsets.to_numpy().astype(np.int64)
    return offsets - offsets[0], rows.values.to_numpy().astype(np.int32)


def _cache_key(path: Path) -> str:
    h = hashlib.sha1()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        f = path / name
        if f.is_file():
            h.update(name.encode() + f.read_bytes())
    h.update(code_digest())  # the code the markers and rows depend on, as the marker cache keys it
    h.update(str(N_CHATS).encode() + _render_rows.__code__.co_code + _content.__code__.co_code + _chat.__code__.co_code)
    if CONTENT != "generated":  # the generated rows keep their cache key
        h.update(CONTENT.encode() + _message.__code__.co_code)
        h.update(hashlib.sha1("\0".join(third_party_chunks()).encode()).digest())
    return h.hexdigest()[:16]


def families() -> list[str]:
    if not TOKENIZERS_DIR.is_dir():
        return []
    return sorted(p.name for p in TOKENIZERS_DIR.iterdir() if (p / "tokenizer_config.json").is_file())


def family_case(family: str) -> tuple[lossmask.Markers, np.ndarray, np.ndarray]:
    """Detected markers and rendered rows of one family, from the cache when it is current."""
    path = TOKENIZERS_DIR / family
    cached = CACHE_DIR / f"{family}-{_cache_key(path)}.npz"
    if cached.is_file():
        data = np.load(cached)
        return lossmask.Markers.from_json(str(data["markers"])), data["offsets"], data["values"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = lossmask.load_tokenizer(path)
        markers = lossmask.detect_markers(tok)
    offsets, values = _render_rows(tok, N_CHATS)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    np.savez(cached, markers=markers.to_json(), offsets=offsets, values=values)
    return markers, offsets, values


def tiled(offsets: np.ndarray, values: np.ndarray, target: int = TARGET_TOKENS) -> pa.LargeListArray:
    """The rows repeated until about ``target`` tokens: LargeList<int32>, as ``encode_texts`` gives."""
    copies = max(1, -(-target // len(values)))
    lengths = np.tile(np.diff(offsets), copies)
    all_offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=all_offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(all_offsets), pa.array(np.tile(values, copies)))


# -- timing ------------------------------------------------------------------------------------

def thread_counts() -> list[int]:
    import numba

    return sorted({min(2, numba.config.NUMBA_NUM_THREADS), 1}, reverse=True)


def kernel_run(rows: pa.Array, markers: lossmask.Markers, out: np.ndarray):
    """The numba kernel alone, writing into ``out`` (a warm buffer, reused): ``make_labels`` less its
    validation, its output allocation and its Arrow assembly."""
    from lossmask.engine.kernels import numba_kernel

    values = rows.values.to_numpy()
    offsets = rows.offsets.to_numpy()
    starts, ends = offsets[:-1] - offsets[0], offsets[1:] - offsets[0]
    out = out[: values.shape[0]]
    return lambda: numba_kernel.label_rows(values, starts, ends, markers, last_turn_only=False, ignore_index=-100,
                                           out=out, write_mask=False)


def timed_runs(rows: pa.Array, markers: lossmask.Markers, *, threads: list[int], copy_out: np.ndarray) -> dict:
    """The runs to time for one case: the copy, ``make_labels`` and the kernel into a warm buffer per thread
    count, ``last_turn_only`` at the first; each a ``(threads, function)`` pair (None: the copy, which numba
    does not run)."""
    lossmask.make_labels(rows.slice(0, 4), markers)  # compile or load the cache outside the timing
    values = rows.values.to_numpy()
    out = copy_out[: values.shape[0]]
    np.copyto(out, values, casting="unsafe")  # touch the pages once before timing
    runs = {"copy": (None, lambda: np.copyto(out, values, casting="unsafe"))}
    kernel_out = np.empty_like(out)
    kernel = kernel_run(rows, markers, kernel_out)
    kernel()  # touch its pages too
    for t in threads:
        runs[f"labels_{t}"] = (t, lambda: lossmask.make_labels(rows, markers))
        runs[f"kernel_{t}"] = (t, kernel)
    runs["last_turn"] = (threads[0], lambda: lossmask.make_labels(rows, markers, last_turn_only=True))
    return runs


def measure(cases: dict[str, tuple[pa.Array, lossmask.Markers]], *, threads: list[int],
            clock=time.perf_counter) -> dict[str, dict]:
    """Mtok/s of each case's runs (``timed_runs``), the copy's among them, in the same run.

    ``REPEAT`` rounds; each round runs every case once, copy and labelling alternating, and the best
    round of each run is kept. So a burst of load on this shared machine, which can last seconds,
    falls on one round of many cases, not on every try of one case."""
    import numba

    size = max(len(rows.values) for rows, _ in cases.values())
    copy_out = np.empty(size, dtype=np.int64)
    runs = {name: timed_runs(rows, markers, threads=threads, copy_out=copy_out) for name, (rows, markers) in cases.items()}
    best = {name: dict.fromkeys(case_runs, float("inf")) for name, case_runs in runs.items()}
    try:
        for _ in range(REPEAT):
            for name, case_runs in runs.items():
                for run_name, (t, run) in case_runs.items():
                    if t is not None:
                        numba.set_num_threads(t)
                    start = clock()
                    run()
                    best[name][run_name] = min(best[name][run_name], clock() - start)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    results = {}
    for name, (rows, markers) in cases.items():
        n = len(rows.values)
        result = {"tokens": n, "patterns": sum(len(getattr(markers, k)) for k in KINDS)}
        result.update({run_name: n / seconds / 1e6 for run_name, seconds in best[name].items()})
        results[name] = result
    return results


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load: " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    """The CPU model, the cores this process may use and numba's threads: a ratio means little without them."""
    import numba

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        import platform

        model = platform.processor() or platform.machine() or model
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, nproc {cores}, numba threads {numba.config.NUMBA_NUM_THREADS}"


def baselines(rows: pa.Array, markers: lossmask.Markers, *, threads: list[int], clock=time.perf_counter) -> str:
    """Yardsticks on one case, each in Mtok/s and as ``make_labels``' fraction of it: a copy into
    a warm buffer, Arrow's cast to list<int64> and NumPy's astype (both fresh outputs, so they pay for their
    pages), beside ``make_labels``, the kernel into a warm buffer, and ``label_batch``."""
    import numba

    values = rows.values.to_numpy()
    n = values.shape[0]
    warm = np.empty(n, dtype=np.int64)
    np.copyto(warm, values, casting="unsafe")
    kernel_out = np.empty(n, dtype=np.int64)
    runs = {
        "np.copyto int32 -> int64 into a warm buffer": (None, lambda: np.copyto(warm, values, casting="unsafe")),
        "pyarrow.compute.cast to list<int64> (fresh output from Arrow's pool)": (
            None, lambda: pa.compute.cast(rows, pa.large_list(pa.int64()))),
        "values.astype(np.int64) (fresh output, page faults)": (None, lambda: values.astype(np.int64)),
    }
    kernel = kernel_run(rows, markers, kernel_out)
    kernel()
    for t in threads:
        runs[f"make_labels, {t} thread{'s' * (t > 1)}"] = (t, lambda: lossmask.make_labels(rows, markers))
        runs[f"kernel into a warm buffer, {t} thread{'s' * (t > 1)}"] = (t, kernel)
        runs[f"label_batch, {t} thread{'s' * (t > 1)}"] = (t, lambda: lossmask.label_batch(rows, markers))
    best = dict.fromkeys(runs, float("inf"))
    try:
        for _ in range(REPEAT):
            for name, (t, run) in runs.items():
                if t is not None:
                    numba.set_num_threads(t)
                start = clock()
                run()
                best[name] = min(best[name], clock() - start)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    labels = best[f"make_labels, {threads[0]} thread{'s' * (threads[0] > 1)}"]
    lines = [f"| run | Mtok/s | make_labels ({threads[0]}) as a fraction of it |", "| --- | ---: | ---: |"]
    for name, seconds in best.items():
        fraction = f"{seconds / labels:.2f}x" if runs[name][0] is None else ""
        lines.append(f"| {name} | {n / seconds / 1e6:,.0f} | {fraction} |")
    return "\n".join(lines)


def table(selected: list[str] | None = None, *, cpu_time: bool = False) -> str:
    threads = [1] if cpu_time else thread_counts()
    clock = time.thread_time if cpu_time else time.perf_counter
    head = ["family", "patterns", "M tokens", "copy Mtok/s"]
    for t in threads:
        head += [f"{t} thread{'s' * (t > 1)} Mtok/s", "ratio", "kernel ratio"]
    if len(threads) > 1:
        head += [f"{threads[0]} threads / 1"]
    head += [f"last_turn_only ({threads[0]}) ratio"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    cases = {}
    for name in selected or families():
        markers, offsets, values = family_case(name)
        cases[name] = (tiled(offsets, values), markers)
    cases[IDEALISED] = (chatml_rows(TARGET_TOKENS // 1000), CHATML)
    for name, r in measure(cases, threads=threads, clock=clock).items():
        cells = [name, str(r["patterns"]), f"{r['tokens'] / 1e6:.1f}", f"{r['copy']:.0f}"]
        for t in threads:
            cells += [f"{r[f'labels_{t}']:.0f}", f"{r[f'labels_{t}'] / r['copy']:.2f}x", f"{r[f'kernel_{t}'] / r['copy']:.2f}x"]
        if len(threads) > 1:
            cells.append(f"{r[f'labels_{threads[0]}'] / r['labels_1']:.2f}x")
        cells.append(f"{r['last_turn'] / r['copy']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the per-family Markdown table")
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by this thread's CPU time (copy too): steadier on a loaded machine")
    parser.add_argument("--content", choices=("generated", "third-party"), default="generated",
                        help="message bodies: whitespace-rich text this file writes (default), or pieces of text "
                             "written by others (installed packages' READMEs, the standard library's modules)")
    parser.add_argument("families", nargs="*", help="only these families (default: every one present)")
    args = parser.parse_args(argv)
    global CONTENT
    CONTENT = args.content
    if not args.table:
        parser.error("pass --table (or run it under pytest: make bench)")
    if not TOKENIZERS_DIR.is_dir():
        print(f"no tokenizers at {TOKENIZERS_DIR} (set LOSSMASK_TOKENIZERS): only the idealised row", file=sys.stderr)
    before = uptime()
    start = time.perf_counter()
    text = table(args.families or None, cpu_time=args.cpu_time)
    clock = "thread CPU time" if args.cpu_time else "wall clock"
    threads = [1] if args.cpu_time else thread_counts()
    yardsticks = baselines(chatml_rows(TARGET_TOKENS // 1000), CHATML, threads=threads,
                           clock=time.thread_time if args.cpu_time else time.perf_counter)
    print(f"\nmachine: {machine()}\n\n{text}\n\nYardsticks on the idealised rows ({IDEALISED}):\n\n{yardsticks}\n\n"
          f"message bodies: {CONTENT}\nuptime before: {before}\nuptime after:  {uptime()}\n"
          f"{time.perf_counter() - start:.0f} s; {clock}, best of {REPEAT} rounds over all cases; ratios are to "
          "np.copyto int32 -> int64 into a warm buffer, single-threaded, in the same round; kernel: the numba kernel "
          "into a warm buffer, without make_labels' checks, allocation and Arrow assembly")


# -- pytest-benchmark ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # standalone use needs no pytest
    pytest = None

if pytest is not None:
    _PARAMS = families() or [pytest.param(None, marks=pytest.mark.skip(reason=f"no tokenizers at {TOKENIZERS_DIR}"))]

    def _report(benchmark, name, n_tokens, baseline_seconds, dtype_name="int64"):
        seconds = benchmark.stats.stats.min
        ratio = baseline_seconds / seconds
        benchmark.extra_info.update(
            mtok_per_s=n_tokens / seconds / 1e6, copy_mtok_per_s=n_tokens / baseline_seconds / 1e6, ratio_to_copy=ratio
        )
        print(f"\n{name}: {n_tokens / 1e6:.1f} M tokens, {n_tokens / seconds / 1e6:,.0f} Mtok/s; "
              f"np.copyto int32->{dtype_name} {n_tokens / baseline_seconds / 1e6:,.0f} Mtok/s; ratio {ratio:.2f}x ({uptime()})")

    @pytest.mark.parametrize("family", _PARAMS)
    def test_make_labels_detected_markers(benchmark, family):
        markers, offsets, values = family_case(family)
        rows = tiled(offsets, values)
        lossmask.make_labels(rows.slice(0, 4), markers)
        baseline = copy_baseline_seconds(rows.values.to_numpy(), np.int64)
        benchmark.pedantic(lossmask.make_labels, args=(rows, markers), rounds=REPEAT, warmup_rounds=1)
        _report(benchmark, f"make_labels {family} (detected markers)", len(rows.values), baseline)

    @pytest.fixture(scope="module")
    def idealised_rows():
        arr = chatml_rows(TARGET_TOKENS // 1000)
        lossmask.make_labels(arr.slice(0, 10), CHATML)
        return arr

    @pytest.mark.parametrize("dtype", ["int64", "int32"])
    def test_make_labels_idealised_chatml(benchmark, idealised_rows, dtype):
        baseline = copy_baseline_seconds(idealised_rows.values.to_numpy(), np.dtype(dtype))
        benchmark.pedantic(lossmask.make_labels, args=(idealised_rows, CHATML), kwargs=dict(dtype=dtype), rounds=7,
                           warmup_rounds=1)
        _report(benchmark, f"make_labels idealised ChatML -> {dtype}", len(idealised_rows.values), baseline, dtype)

    def test_label_batch_last_turn_only_idealised(benchmark, idealised_rows):
        baseline = copy_baseline_seconds(idealised_rows.values.to_numpy())
        benchmark.pedantic(lossmask.label_batch, args=(idealised_rows, CHATML), kwargs=dict(last_turn_only=True), rounds=5)
        _report(benchmark, "label_batch idealised ChatML, last_turn_only", len(idealised_rows.values), baseline)

    def test_make_labels_numpy_reference(benchmark, idealised_rows):
        subset = idealised_rows.slice(0, 2_000)  # the reference loops over rows in Python: a tenth of the data
        n = subset.offsets[-1].as_py() - subset.offsets[0].as_py()
        baseline = copy_baseline_seconds(subset.flatten().to_numpy())
        benchmark.pedantic(lossmask.make_labels, args=(subset, CHATML), kwargs=dict(backend="numpy"), rounds=1)
        _report(benchmark, "make_labels numpy reference (2,000 rows)", n, baseline)


if __name__ == "__main__":
    main()
