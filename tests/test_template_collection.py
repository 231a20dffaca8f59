"""Every real chat template of llama.cpp's collection trains what it should, through ``mask_files``.

The 70 templates (``tests/fixtures/template_collection.py``: fetched once from the ``llama-cpp-python``
source package, never copied here) include this year's reasoning templates whose token markers cannot be
read (Gemma-4, DeepSeek-V3.2, GLM-4.6, Nemotron-3, MiniMax-M2 ...): those are labelled from each row's
rendering. For every template that renders a chat, on a plain two-turn chat, a system + two-turn chat and
a chat whose user quotes the template's own assistant header:

- every assistant reply trains, and so does the stop token after it (the first special token the rendering
  writes after the reply, before the next message);
- no user or system text trains, and nothing of what the generation prompt supplies (the assistant header);
- no such chat is dropped.

The oracle reads the rendering from ``apply_chat_template`` itself and each token's bytes from the ids
lossmask wrote, not from lossmask's own rendering code.
"""

from __future__ import annotations

import json
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import template_collection as collection  # noqa: E402

sys.path.pop(0)

NAMES = (
    "Apertus-8B-Instruct", "Apriel-1.6-15b-Thinker-fixed", "Bielik-11B-v3.0-Instruct", "ByteDance-Seed-OSS",
    "Cohere2MoE", "CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "GLM-4.6", "GLM-4.7-Flash", "GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "HuggingFaceTB-SmolLM3-3B",
    "Kimi-K2-Instruct", "Kimi-K2-Thinking", "Kimi-K3", "LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct", "MiMo-VL",
    "MiniMax-M1", "MiniMax-M2", "MiniMax-M3", "Mistral-Small-3.2-24B-Instruct-2506",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "NVIDIA-Nemotron-Nano-v2", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
    "Qwen3-Coder", "Qwen3.5-4B", "Reka-Edge", "Spark2.5", "StepFun3.5-Flash", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-V3.2",
    "deepseek-ai-DeepSeek-V4-Flash-0731", "deepseek-ai-DeepSeek-V4", "fireworks-ai-llama-3-firefunction-v2",
    "google-gemma-2-2b-it", "google-gemma-4-31B-it-interleaved", "google-gemma-4-31B-it", "ibm-granite-granite-3.3-2B-Instruct",
    "ibm-granite-granite-4.0", "ibm-granite-granite-4.1", "inclusionai-ling-3.0-flash", "llama-cpp-deepseek-r1",
    "llama-cpp-rwkv-world", "meetkai-functionary-medium-v3.1", "meetkai-functionary-medium-v3.2",
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "meta-llama-Llama-3.3-70B-Instruct",
    "microsoft-Phi-3.5-mini-instruct", "mistralai-Ministral-3-14B-Reasoning-2512", "mistralai-Mistral-Nemo-Instruct-2407",
    "moonshotai-Kimi-K2", "muse-glimmer", "openai-gpt-oss-120b", "openbmb-MiniCPM5-1B", "poolside-Laguna-S-2.1",
    "poolside-Laguna-XS-2.1", "poolside-Laguna-XS.2", "tencent-Hy3", "unsloth-Apriel-1.5",
    "unsloth-mistral-Devstral-Small-2507", "upstage-Solar-Open-100B",
)

@lru_cache(maxsize=1)
def _folder() -> Path:
    folder, why = collection.collection_dir()
    if folder is None:
        pytest.skip(why)
    return folder


def test_the_collection_is_the_pinned_one():
    assert sorted(p.stem for p in _folder().glob("*.jinja")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_template_that_renders_a_chat_trains_replies_and_stops_only(name, tmp_path):
    from lossmask import load_tokenizer, mask_files, resolve_markers

    tok = collection.tokenizer_for((_folder() / f"{name}.jinja").read_text(encoding="utf-8"))
    chats = collection.chats_for(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # one adapter over the tokenizer for the policy and mask_files: what it reads off the template once, both reuse
        ct = load_tokenizer(tok)
        resolution = resolve_markers(ct)
    if not chats:  # (made for tool use: it renders chats given tools, and is labelled from its rendering then)
        pytest.skip(f"{name} renders no chat without tools or documents")
    assert resolution.source != "none", f"{name} renders chats, yet the full sequence would train"
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(source, tmp_path / "out.parquet", tokenizer=ct)
    assert report.rows_out == len(chats), f"{name} ({resolution.source}) dropped a plain chat: {report.summary()}"
    table = pq.read_table(tmp_path / "out.parquet")
    for chat, ids, labels in zip(chats, table["input_ids"].to_pylist(), table["labels"].to_pylist()):
        found = collection.problems(tok, chat, ids, labels)
        assert not found, (name, resolution.source, found)
