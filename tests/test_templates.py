"""The template table: name normalisation, most-specific matching, and every entry verified on a real tokenizer."""

from __future__ import annotations

import pytest

from conftest import REPO_ROOT, chat_tokenizer, tokenizer_families
from lossmask.markers.templates import load_table, match_template, normalise_model_name, parse_table, table_markdown, table_markers

FAMILIES = [
    "alpaca", "chatml", "deepseek-v3", "deepseek-v3.1", "falcon", "gemma-2", "gemma-3", "glm-4", "gpt-oss", "lfm2",
    "llama-2", "llama-3", "llama-3.1", "llama-3.2", "mistral-nemo", "mistral-v1", "mistral-v3", "olmo-2", "openchat",
    "phi-3", "phi-3.5", "phi-4", "qwen2.5", "qwen3", "smollm3", "vicuna", "zephyr",
]


def test_normalise_model_name():
    assert normalise_model_name("Qwen/Qwen2.5-7B-Instruct") == ("qwen", "2", "5", "7", "b", "instruct")
    assert normalise_model_name("/models/ckpt/gpt_oss-20b-SFT/") == ("gpt", "oss", "20", "b", "sft")
    assert normalise_model_name(r"C:\models\Llama 3.1 8B") == ("llama", "3", "1", "8", "b")
    assert normalise_model_name("qwen2_5") == normalise_model_name("QWEN-2.5") == ("qwen", "2", "5")
    assert normalise_model_name("") == ()
    hub_cache = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/9c925d64d72725edaf899c6cb9c377fd0709d9c5"
    assert normalise_model_name(hub_cache) == ("qwen", "3", "8", "b")
    assert normalise_model_name("runs/Llama-3.1-8B-sft/checkpoint-500/") == ("llama", "3", "1", "8", "b", "sft")
    assert normalise_model_name("out/step_1200") == ("out",)


def test_every_family_is_in_the_table_under_its_own_name():
    table = load_table()
    assert set(FAMILIES) <= set(table.templates)
    for family in FAMILIES:
        match = match_template(family)
        assert match is not None and match.template == family, (family, match)


@pytest.mark.parametrize(
    "name, template",
    [
        # renamed and fine-tuned checkpoints
        ("org/gpt-oss-20b-sft", "gpt-oss"),
        ("my-qwen2.5-7b-instruct-lora", "qwen2.5"),
        ("qwen2_5-0.5b-dpo-2024-06-01", "qwen2.5"),
        ("unsloth/Qwen3-8B-unsloth-bnb-4bit", "qwen3"),
        ("gemma-3-27b-it-GGUF", "gemma-3"),
        # the most specific pattern wins
        ("Qwen/Qwen3-0.6B", "qwen3"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5"),
        ("Qwen/Qwen1.5-7B-Chat", "qwen2.5"),
        ("Qwen/Qwen2-0.5B-Instruct", "qwen2.5"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.1"),
        ("meta-llama/Llama-3.2-1B-Instruct", "llama-3.2"),
        ("meta-llama/Llama-2-7b-chat-hf", "llama-2"),
        ("codellama/CodeLlama-7b-Instruct-hf", "llama-2"),
        ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-v1"),
        ("mistralai/Mistral-7B-Instruct-v0.2", "mistral-v1"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral-v3"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistral-v1"),
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mistral-v3"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo"),
        ("google/gemma-2-9b-it", "gemma-2"),
        ("google/gemma-7b-it", "gemma-2"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3"),
        ("microsoft/Phi-3.5-mini-instruct", "phi-3.5"),
        ("microsoft/phi-4", "phi-4"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-V3.1-Base", "deepseek-v3.1"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "deepseek-v3"),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "deepseek-v3"),
        ("THUDM/glm-4-9b-chat", "glm-4"),
        ("zai-org/GLM-4.5-Air", "glm-4"),
        ("allenai/OLMo-2-1124-7B-Instruct", "olmo-2"),
        ("allenai/Llama-3.1-Tulu-3-8B", "olmo-2"),
        ("HuggingFaceTB/SmolLM3-3B", "smollm3"),
        ("HuggingFaceTB/SmolLM2-1.7B-Instruct", "chatml"),
        ("LiquidAI/LFM2-1.2B", "lfm2"),
        ("openchat/openchat-3.5-0106", "openchat"),
        ("Nexusflow/Starling-LM-7B-beta", "openchat"),
        ("lmsys/vicuna-7b-v1.5", "vicuna"),
        ("tiiuae/falcon-7b-instruct", "falcon"),
        ("HuggingFaceH4/zephyr-7b-beta", "zephyr"),
        ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "zephyr"),
        ("teknium/OpenHermes-2.5-Mistral-7B", "chatml"),
        ("NousResearch/Nous-Hermes-2-Mixtral-8x7B-DPO", "chatml"),
        ("NousResearch/Hermes-3-Llama-3.1-8B", "chatml"),
        ("01-ai/Yi-34B-Chat", "chatml"),
    ],
)
def test_model_names_match_the_most_specific_pattern(name, template):
    match = match_template(name)
    assert match is not None and match.template == template, (name, match)
    assert match.entry is not None and match.entry.name == template


@pytest.mark.parametrize("name", ["tiiuae/Falcon3-7B-Instruct", "microsoft/Phi-4-mini-instruct", "THUDM/chatglm3-6b",
                                  "meta-llama/Llama-4-Scout-17B-16E-Instruct"])
def test_known_unsupported_families_are_not_claimed_by_a_looser_pattern(name):
    match = match_template(name)
    assert match is not None and match.template is None and match.entry is None


@pytest.mark.parametrize("name", ["gpt2", "bert-base-uncased", "", "my-model", "dolphinfish-7b", "nemotron-4"])
def test_unknown_names_match_nothing(name):
    assert match_template(name) is None


def test_match_rejects_a_non_string():
    with pytest.raises(TypeError, match="model_name must be a string"):
        load_table().match(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data, message",
    [
        ({"templates": {"t": {"response": ["x"]}}, "models": [{"pattern": "m", "template": "nope"}]}, "unknown template 'nope'"),
        ({"templates": {"t": {"response": ["x"], "ends": ["y"]}}}, "unknown keys"),
        ({"templates": {"t": {"response": []}}}, "at least one response"),
        ({"templates": {"t": {"response": ["x"], "end": [""]}}}, "non-empty strings"),
        ({"templates": {"t": {"response": ["x"]}}, "models": [{"pattern": "--", "template": "t"}]}, "holds no words"),
    ],
)
def test_parse_table_names_the_bad_entry(data, message):
    with pytest.raises(ValueError, match=message):
        parse_table(data)


def test_pattern_groups_allow_words_between_them():
    table = parse_table({
        "templates": {"a": {"response": ["x"]}, "b": {"response": ["y"]}},
        "models": [{"pattern": "fam", "template": "a"}, {"pattern": "fam*v2", "template": "b"}],
    })
    assert table.match("Fam-7B-Instruct-v2").template == "b"
    assert table.match("Fam-7B-Instruct-v1").template == "a"
    assert table.match("v2-fam").template == "a"  # groups must occur in order


@pytest.mark.parametrize("family", FAMILIES)
def test_table_entry_verifies_exactly_on_the_real_tokenizer(family):
    """Each entry's strings, located in probes rendered by the family's own template, reproduce the ground truth."""
    from lossmask.markers.verify import verify

    ct = chat_tokenizer(family)  # loaded once per test run (tests/conftest.py)
    markers = table_markers(ct, family)
    report = verify(ct, markers)
    assert report.ok, str(report)


def test_the_families_under_test_are_the_shared_ones():
    shared = tokenizer_families()
    if not shared:
        pytest.skip("shared tokenizers absent (set LOSSMASK_TOKENIZERS)")
    assert sorted(FAMILIES) == shared


def test_the_table_document_is_current():
    doc = REPO_ROOT / "docs" / "template-table.md"
    assert doc.read_text(encoding="utf-8") == table_markdown(), (
        "docs/template-table.md is out of date; regenerate it: python -c \"from lossmask.markers.templates import table_markdown; "
        "open('docs/template-table.md', 'w').write(table_markdown())\""
    )
