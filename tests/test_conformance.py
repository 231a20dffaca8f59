"""Conformance: on every shared tokenizer, detected markers reproduce the ground truth exactly.

The families are listed here (not discovered) so that a missing folder shows as a skip with its
name. docs/conformance.md is the same check as a table (benchmarks/conformance.py).
"""

from __future__ import annotations

import random

import pytest

from conftest import chat_tokenizer, detected_markers
from lossmask import verify
from lossmask.chat.probes import renderable_probes
from lossmask.markers.verify import GroundTruth, build_truths

FAMILIES = [
    "alpaca", "chatml", "deepseek-v3", "deepseek-v3.1", "falcon", "gemma-2", "gemma-3", "glm-4", "gpt-oss",
    "lfm2", "llama-2", "llama-3", "llama-3.1", "llama-3.2", "mistral-nemo", "mistral-v1", "mistral-v3",
    "olmo-2", "openchat", "phi-3", "phi-3.5", "phi-4", "qwen2.5", "qwen3", "smollm3", "vicuna", "zephyr",
]

# The stop tokens each template must train (docs/masking-rule.md); an independent check that the
# ground truth and the detection did not agree on something wrong.
STOP_TOKENS = {
    "alpaca": {"</s>"}, "chatml": {"<|im_end|>"}, "deepseek-v3": {"<｜end▁of▁sentence｜>"},
    "deepseek-v3.1": {"<｜end▁of▁sentence｜>"}, "falcon": set(), "gemma-2": {"<end_of_turn>"},
    "gemma-3": {"<end_of_turn>"}, "glm-4": {"<|user|>", "<|observation|>"},
    "gpt-oss": {"<|end|>", "<|return|>", "<|call|>"}, "lfm2": {"<|im_end|>"}, "llama-2": {"</s>"},
    "llama-3": {"<|eot_id|>"}, "llama-3.1": {"<|eot_id|>"}, "llama-3.2": {"<|eot_id|>"},
    "mistral-nemo": {"</s>"}, "mistral-v1": {"</s>"}, "mistral-v3": {"</s>"}, "olmo-2": {"<|endoftext|>"},
    "openchat": {"<|end_of_turn|>"}, "phi-3": {"<|end|>"}, "phi-3.5": {"<|end|>"}, "phi-4": {"<|im_end|>"},
    "qwen2.5": {"<|im_end|>"}, "qwen3": {"<|im_end|>"}, "smollm3": {"<|im_end|>"}, "vicuna": {"</s>"},
    "zephyr": {"</s>"},
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    """One family; module-scoped, so that pytest runs each family's tests one after the other and its tokenizer and
    markers are used while loaded (a file that went through every family once per test would load them again once
    the shared caches are emptied at their size bound)."""
    return request.param


def test_detected_markers_verify_exactly(family):
    ct = chat_tokenizer(family)
    markers, report = detected_markers(family)
    assert report.ok, str(report)
    assert report.missing == 0 and report.extra == 0 and report.errors == 0
    assert {ct.decode(p) for p in markers.end} == STOP_TOKENS[family]


def test_ground_truth_starts_where_the_generation_prompt_ends(family):
    """Where the generation prompt's tokens are a prefix of the whole chat's tokens, the first
    trained token of that turn is the one right after them: a token-level cross-check of the
    character-level ground truth."""
    ct = chat_tokenizer(family)
    probe = renderable_probes(ct)[0]
    (truth,) = build_truths(ct, [probe])
    assert isinstance(truth, GroundTruth), truth
    ids = truth.ids.tolist()
    checked = 0
    for turn in truth.turns:
        prompt = ct.encode(ct.render(probe.messages[: turn.message], add_generation_prompt=True))
        if ids[: len(prompt)] != prompt:
            continue  # not prefix-stable here (dates, Qwen3's think block...): nothing to compare
        assert truth.should_train[len(prompt)], (family, turn.message, "first generated token not trained")
        assert not truth.should_train[len(prompt) - 1], (family, turn.message, "last prompt token trained")
        checked += 1
    if family not in {"gpt-oss", "qwen3"}:
        assert checked, f"{family}: no turn was prefix-stable"


_WHITESPACE = ["", "", "", "", " ", "  ", "\n", "\n\n", "\t", " \n", "\n ", "\r\n", "\n\n\n", "    "]
_WORDS = ["hello", "Paris", "x=1", "日本語", "🙂", "Ça", "###", "[x]", "<b>", "{}", "User", "assistant", "**bold**",
          "1.", "-", "def f():", "'", '"', "\\", "ok.", "!", "?", "Привет", "naïve", "$", "`code`", "[INST]"]


def random_conversations(seed: int, count: int) -> list[list[dict]]:
    """Conversations the probes never saw: random words, whitespace at both ends, 1-4 turns.

    No content holds a response marker's text ('[/INST]'): that opens a span on any marker-based
    labelling (docs/masking-rule.md, limits)."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
        return f"{rng.choice(_WHITESPACE)}{words} w{k}{rng.choice(_WHITESPACE)}"

    conversations = []
    for c in range(count):
        messages = [{"role": "system", "content": text(c * 100 + 99)}] if rng.random() < 0.3 else []
        for t in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": text(c * 100 + 2 * t)},
                         {"role": "assistant", "content": text(c * 100 + 2 * t + 1)}]
        conversations.append(messages)
    return conversations


def test_detected_markers_hold_on_unseen_conversations(family):
    ct = chat_tokenizer(family)
    markers, report = detected_markers(family)
    # templates that reject a system role (Gemma-2) or drop it (Phi-3; Mistral v3/Nemo when the chat
    # ends with an assistant turn) render no system conversation: those are verified without one
    system = dict((kind, status) for kind, status, _ in report.kinds)["system"] == "exact"
    conversations = []
    for messages in random_conversations(seed=FAMILIES.index(family), count=12):
        if not system:
            messages = [m for m in messages if m["role"] != "system"]
        conversations.append(messages)
    report = verify(ct, markers, conversations)
    assert report.ok, str(report)


def test_conformance_script_writes_the_table(tmp_path, monkeypatch):
    from conftest import REPO_ROOT, load_script, tokenizer_path

    # skips when the fixtures are absent; the script reads the folder conftest found (shared or built)
    monkeypatch.setenv("LOSSMASK_TOKENIZERS", str(tokenizer_path("chatml").parent))
    script = load_script(REPO_ROOT / "benchmarks" / "conformance.py")
    out = tmp_path / "conformance.md"
    assert script.main(["--out", str(out), "chatml", "falcon"]) == 0
    text = out.read_text(encoding="utf-8")
    assert "**2 of 2 families exact.**" in text
    assert "| chatml | real base + 2 added tokens | detected | `<\\|im_start\\|> assistant\\n` | `<\\|im_end\\|>` |" in text
    assert "## Kinds of conversation verified" in text
    assert "| chatml | exact | exact | exact | no | no | no |" in text
    assert "- **chatml**, tools: the template raised: Conversation roles must alternate" in text
