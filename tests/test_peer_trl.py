"""A peer oracle: lossmask's labels against TRL's training chat templates, on the same token ids.

TRL ships patched chat templates with ``{% generation %}`` blocks around what an assistant turn
trains (``trl.chat_template_utils.get_training_chat_template``; SmolLM3's own template has them), and
``apply_chat_template(..., return_assistant_tokens_mask=True)`` turns the blocks into a 0/1 mask. For
every shared family TRL has such a template for, lossmask detects markers on that same template and
labels the ids its messages path gives (``encode_chats``; the same ids as TRL's unless a message
quotes a special token and content is encoded as data, and then TRL's mask is carried over by
aligning the two id sequences), and the two are compared token by token over hand-written
conversations (tests/data/peer_conversations.json: tools, parallel tools, reasoning, whitespace
edges, quoted markers), written apart from lossmask's own probes.

Every disagreement must be one of the named definitional differences below, each explained in
docs/masking-rule.md ("Differences from TRL's training templates"); any other fails the test.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO_ROOT, tokenizer_path

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

# family -> TRL training template (file name in trl/chat_templates), None: the family's own template
# already has {% generation %} blocks (SmolLM3)
PEERS = {
    "deepseek-v3": "deepseekv3_training",
    "gemma-2": "gemma_training",
    "gemma-3": "gemma3_training",
    "glm-4": "glm4moe_training",
    "gpt-oss": "gptoss_training",
    "lfm2": "lfm2_training",
    "llama-3": "llama3_training",
    "phi-3": "phi3_training",
    "phi-3.5": "phi3_5_training",
    "qwen2.5": "qwen2_5_training",
    "qwen3": "qwen3_training",
    "smollm3": None,
}

# The named definitional differences, the runs of tokens each one explains, and the families where
# TRL's template shows it. docs/masking-rule.md gives the reason for each, under the same name.
#   "header":    TRL trains tokens of the assistant header (some or all of a response pattern)
#                right before the content lossmask trains
#   "separator": TRL trains the whitespace the template writes after the stop token
#   "eos":       TRL trains a special token the template writes after the whole chat
DIFFERENCES = {
    "header-in-generation-block": {
        "runs": "header", "families": {"deepseek-v3", "gpt-oss", "qwen2.5", "smollm3"}},
    "straddling-token": {
        "runs": "header", "families": {"lfm2", "phi-3", "phi-3.5"}},
    "separator-after-stop-token": {
        "runs": "separator", "families": {"gemma-2", "gemma-3", "lfm2", "qwen2.5", "qwen3", "smollm3"}},
    "eos-after-the-chat": {
        "runs": "eos", "families": {"phi-3", "phi-3.5"}},
}

CONVERSATIONS = json.loads((REPO_ROOT / "tests" / "data" / "peer_conversations.json").read_text(encoding="utf-8"))

_PEER_CACHE: dict = {}


def _peer(family: str):
    """``(hf tokenizer, training template, lossmask ChatTokenizer on it, detected markers)``, once per family."""
    if family not in _PEER_CACHE:
        from lossmask import ChatTokenizer
        from lossmask.markers.detect import detect_markers_with_report

        hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(family)), local_files_only=True)
        name = PEERS[family]
        template = hf.chat_template if name is None else (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        ct = ChatTokenizer(hf, chat_template=template, name=f"{family}+trl")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            markers, _ = detect_markers_with_report(ct)
        _PEER_CACHE[family] = (hf, template, ct, markers)
    return _PEER_CACHE[family]


def _runs(disagree: np.ndarray, trl_trained: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs ``[a, b)`` of disagreeing tokens where the same side trains."""
    runs, k, n = [], 0, len(disagree)
    while k < n:
        if disagree[k]:
            j = k
            while j < n and disagree[j] and trl_trained[j] == trl_trained[k]:
                j += 1
            runs.append((k, j))
            k = j
        else:
            k += 1
    return runs


def _carry_mask(theirs_ids: list[int], mask: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """TRL's token mask moved onto another tokenisation of the same text.

    The two differ only where a message quotes a special token (one control token in TRL's ids,
    several text tokens in lossmask's): aligned blocks keep TRL's mask, and each token of a
    differing block takes the mask of the TRL tokens it replaces (they lie in one message, so they
    agree; where they do not, the block counts as trained by TRL if any of them is).
    """
    import difflib

    out = np.zeros(len(ids), dtype=bool)
    matcher = difflib.SequenceMatcher(None, theirs_ids, ids.tolist(), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out[j1:j2] = mask[i1:i2]
        elif j2 > j1:
            out[j1:j2] = mask[i1:i2].any() if i2 > i1 else mask[max(i1 - 1, 0)]
    return out


def classify(run, ids, ours, theirs, markers, ct) -> str | None:
    """Which kind of listed difference a run is ("header", "separator", "eos"), or None."""
    a, b = run
    if not theirs[a] or ours[a:b].any():
        return None  # only TRL-only runs are listed differences
    tokens = tuple(int(t) for t in ids[a:b])
    if b < len(ids) and ours[b]:  # right before content that lossmask trains
        if any(p[len(p) - len(tokens):] == tokens for p in markers.response if len(p) >= len(tokens)):
            return "header"
    end_ids = {p[-1] for p in markers.end}
    if a > 0 and int(ids[a - 1]) in end_ids and ours[a - 1] and not ct.decode(tokens).strip():
        return "separator"
    if b == len(ids) and a > 0 and all(t in ct.special_ids for t in tokens):
        if ours[a - 1] and int(ids[a - 1]) in end_ids:
            return "eos"
    return None


# Conversations whose message these templates drop (read off the renderings by hand): the messages path
# counts such a row as content_dropped, naming the message, instead of training an empty turn.
TEMPLATE_DROPS = {
    **{(family, name): "message 1 (assistant): its tool call arguments"
       for family in ("llama-3", "lfm2", "smollm3", "phi-3", "phi-3.5")  # these templates write no tool call
       for name in ("tool-single", "tool-parallel", "tool-json-string-arguments")},
    # gpt-oss writes one tool call per assistant message: the second of a parallel pair is dropped
    ("gpt-oss", "tool-parallel"): "message 1 (assistant): its tool call arguments",
    ("gpt-oss", "tool-json-string-arguments"): "message 1 (assistant): its tool call arguments",  # two calls too
}


# What these templates refuse to render (they raise): checked on their own below, not compared.
UNRENDERABLE = {
    ("gemma-2", "support-with-system"), ("gemma-2", "tool-single"), ("gemma-2", "tool-parallel"),
    ("gemma-2", "tool-json-string-arguments"), ("gemma-3", "tool-single"), ("gemma-3", "tool-parallel"),
    ("gemma-3", "tool-json-string-arguments"), ("glm-4", "tool-json-string-arguments"),
}


@pytest.mark.parametrize("family, name", sorted(UNRENDERABLE), ids=[f"{f}-{n}" for f, n in sorted(UNRENDERABLE)])
def test_templates_refuse_what_they_cannot_render(family, name):
    _, _, ct, _ = _peer(family)
    conv = next(c for c in CONVERSATIONS if c["name"] == name)
    with pytest.raises(ValueError):
        ct.render(conv["messages"], tools=conv.get("tools"))


def _cases():
    for family in PEERS:
        for conv in CONVERSATIONS:
            if (family, conv["name"]) in UNRENDERABLE:
                continue
            yield pytest.param(family, conv["name"], id=f"{family}-{conv['name']}")


@pytest.mark.parametrize("family, name", list(_cases()))
def test_labels_agree_with_trl_but_for_listed_differences(family, name):
    from lossmask import label_batch

    hf, template, ct, markers = _peer(family)
    conv = next(c for c in CONVERSATIONS if c["name"] == name)
    messages, tools = conv["messages"], conv.get("tools")
    text = ct.render(messages, tools=tools)  # what a template refuses is listed in UNRENDERABLE
    out = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == ct.encode(text), "TRL and lossmask render or tokenise the chat differently"
    theirs = np.asarray(out["assistant_masks"], dtype=bool)
    # the ids lossmask's messages path trains on; where content is encoded as data they differ from
    # TRL's for messages that quote special tokens, and TRL's mask is carried over by alignment
    encoded = ct.encode_chats([{"messages": messages, "tools": tools}])
    if encoded.dropped:  # the messages path refuses a row whose message the template dropped: never labelled
        assert (family, name) in TEMPLATE_DROPS, f"{family}, {name}: refused unexpectedly: {encoded.dropped}"
        assert encoded.dropped[0][1] == "content_dropped" and TEMPLATE_DROPS[family, name] in encoded.dropped[0][2]
        return
    assert (family, name) not in TEMPLATE_DROPS, f"{family}, {name}: the template keeps every message now"
    ids = np.asarray(encoded.input_ids.to_pylist()[0], dtype=np.int64)
    if ids.tolist() != list(out["input_ids"]):
        theirs = _carry_mask(list(out["input_ids"]), theirs, ids)
    # labelled as the messages path labels: message text is inert for the markers
    ours = np.asarray(label_batch(encoded.input_ids, markers, data_mask=encoded.in_content).labels[0].as_py()) != -100
    assert ours.any() and theirs.any()
    unlisted = []
    for run in _runs(ours != theirs, theirs):
        kind = classify(run, ids, ours, theirs, markers, ct)
        names = [n for n, d in DIFFERENCES.items() if d["runs"] == kind and family in d["families"]]
        if not names:
            side = "TRL trains, lossmask masks" if theirs[run[0]] else "lossmask trains, TRL masks"
            unlisted.append(f"{side}: {ct.decode(ids[run[0]:run[1]])!r} (tokens {run[0]}-{run[1] - 1})")
    assert not unlisted, f"{family}, {name}: disagreements not listed in DIFFERENCES:\n" + "\n".join(unlisted)


def test_every_listed_difference_is_documented():
    text = (REPO_ROOT / "docs" / "masking-rule.md").read_text(encoding="utf-8")
    section = text.split("## Differences from TRL's training templates", 1)
    assert len(section) == 2, "docs/masking-rule.md lacks the section on TRL's training templates"
    for name in DIFFERENCES:
        assert f"`{name}`" in section[1], f"difference {name!r} is not explained in docs/masking-rule.md"


def test_the_peer_templates_are_the_ones_trl_picks():
    """For the families whose own template TRL recognises, get_training_chat_template returns the
    template this file compares with (the others use TRL's template for the family directly)."""
    from trl.chat_template_utils import get_training_chat_template

    for family in ("gemma-2", "gemma-3", "gpt-oss", "phi-3.5", "qwen2.5"):
        hf = _peer(family)[0]  # the family's own tokenizer, as loaded once for the comparisons (its template unchanged)
        expected = (TRL_TEMPLATES / f"{PEERS[family]}.jinja").read_text(encoding="utf-8")
        assert get_training_chat_template(hf) == expected, family


def test_trl_mask_is_carried_over_to_another_tokenisation():
    """A quoted control token (one id in TRL's row) encoded as text (several ids in lossmask's)."""
    mask = np.array([0, 1, 1, 0], dtype=bool)
    carried = _carry_mask([1, 50, 2, 3], mask, np.array([1, 7, 8, 2, 3]))
    assert carried.tolist() == [False, True, True, True, False]
    assert _carry_mask([1, 2], np.array([0, 1], dtype=bool), np.array([1, 2])).tolist() == [False, True]
