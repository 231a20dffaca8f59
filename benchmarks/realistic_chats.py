"""Deterministic chats of the shape people fine-tune on, for the end-to-end benchmarks (no tokenizer needed).

Multi-turn (1-4 user/assistant pairs), a system prompt in most rows, and content with what real data
holds: paragraphs, numbered and bulleted lists, code blocks with indentation, inline code, numbers
and a little non-ASCII. About 4,000 characters (~960 tokens on Llama-3 / Qwen2.5 vocabularies) a chat.

    from realistic_chats import chats
    rows = chats(20_000)            # list of message lists, the same on every run
    write_parquet(path, 20_000)     # a Parquet file with a ``messages`` column
"""

from __future__ import annotations

import random

WORDS = (
    "model data training loss token batch value result answer question system user reason step method "
    "function error file table row column memory speed layer weight gradient sample label output input "
    "the a of to and in is that for it with as on be by this are from at or an which we can not have"
).split()
SYSTEMS = (
    "You are a careful assistant. Answer precisely, show your reasoning briefly, and say when you are unsure.",
    "You are a senior Python engineer. Prefer small functions, clear names and tests.",
    "Answer in the user's language. Keep answers under 300 words unless asked for more.",
)
NAMES = ("Zoë", "José", "Łukasz", "Amélie", "Søren", "Ngozi", "Hiroshi")


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), f"{rng.randint(2, 9999):,}")
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), rng.choice(NAMES))
    return " ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!"))


def _paragraph(rng: random.Random, n: int) -> str:
    return " ".join(_sentence(rng) for _ in range(n))


def _code(rng: random.Random) -> str:
    name = rng.choice(("load_rows", "mask_batch", "count_tokens", "merge_spans"))
    lines = [f"def {name}(rows, limit={rng.randint(2, 512)}):", '    """Return the rows that fit."""', "    out = []"]
    for _ in range(rng.randint(2, 6)):
        lines.append(f"    for r in rows[: limit // {rng.randint(2, 8)}]:")
        lines.append(f"        if len(r) > {rng.randint(0, 64)}:")
        lines.append("            out.append(r)")
    lines.append("    return out")
    return "```python\n" + "\n".join(lines) + "\n```"


def _reply(rng: random.Random) -> str:
    parts = [_paragraph(rng, rng.randint(3, 7))]
    kind = rng.randrange(4)
    if kind == 0:
        parts.append("\n".join(f"{i}. {_sentence(rng)}" for i in range(1, rng.randint(3, 7))))
    elif kind == 1:
        parts.append("\n".join(f"- **{rng.choice(WORDS)}**: {_sentence(rng)}" for _ in range(rng.randint(3, 6))))
    elif kind == 2:
        parts.append(_code(rng))
        parts.append(f"Call it as `{rng.choice(WORDS)}(rows)`; it runs in O(n).")
    parts.append(_paragraph(rng, rng.randint(2, 5)))
    return "\n\n".join(parts)


def chat(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.7 else []
    for _ in range(rng.choice((1, 2, 3, 3, 4, 5))):
        question = _paragraph(rng, rng.randint(2, 4))
        if rng.random() < 0.3:
            question += "\n\n" + _code(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": _reply(rng)})
    return messages


def chats(n: int, *, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    return [chat(rng) for _ in range(n)]


def write_parquet(path, n: int, *, seed: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": chats(n, seed=seed)}), path)
