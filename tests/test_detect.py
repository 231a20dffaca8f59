"""detect_markers on real templates and on templates that cannot be analysed; markers_from_strings."""

from __future__ import annotations

import pytest

from conftest import chat_tokenizer, detected_markers, tokenizer_path
from lossmask import ChatTokenizer, MarkerDetectionError, Markers, detect_markers, load_tokenizer, markers_from_strings, verify
from lossmask.detect import detect_markers_with_report


def decoded(ct, patterns) -> set[str]:
    return {ct.decode(p) for p in patterns}


def test_detect_chatml_family_keeps_in_context_variants():
    ct = chat_tokenizer("qwen2.5")
    markers, report = detected_markers("qwen2.5")
    assert report.ok and report.tokens > 1000
    assert "<|im_start|>assistant\n" in decoded(ct, markers.response)
    assert "<|im_start|>assistant\n\n" in decoded(ct, markers.response)  # '\n' merged with content's '\n'
    assert decoded(ct, markers.end) == {"<|im_end|>"} and markers.instruction == ()


@pytest.mark.parametrize(
    "family, response, end, instruction",
    [
        ("gpt-oss", {"<|start|>assistant"}, {"<|end|>", "<|return|>", "<|call|>"}, set()),
        ("glm-4", {"<|assistant|>"}, {"<|user|>", "<|observation|>"}, set()),
        ("mistral-v3", {"[/INST]", "[/TOOL_RESULTS]"}, {"</s>"}, set()),
        ("phi-3", {"<|assistant|>"}, {"<|end|>"}, set()),
    ],
)
def test_detect_reads_the_stop_tokens_of_each_template(family, response, end, instruction):
    ct = chat_tokenizer(family)
    markers, _ = detected_markers(family)
    assert decoded(ct, markers.response) == response
    assert decoded(ct, markers.end) == end
    assert decoded(ct, markers.instruction) == instruction


def test_detect_plain_text_roles_closes_on_the_next_header():
    ct = chat_tokenizer("falcon")
    with pytest.warns(UserWarning, match="no stop token"):
        markers = detect_markers(ct)
    assert markers.end == ()  # Falcon's template emits no stop token
    assert any(text.strip() == "User:" for text in decoded(ct, markers.instruction))
    assert any(text.strip() == "Assistant:" for text in decoded(ct, markers.response))


def _with_template(template) -> ChatTokenizer:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path("chatml")))
    return ChatTokenizer(hf, chat_template=template)


def test_template_without_generation_prompt_is_refused():
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(MarkerDetectionError, match="no generation prompt"):
        detect_markers(_with_template(template))


def test_template_that_raises_on_everything_is_refused():
    with pytest.raises(MarkerDetectionError, match="renders none of the probe conversations"):
        detect_markers(_with_template("{{ raise_exception('nope') }}"))


def test_template_without_boundaries_is_refused():
    """Contents glued together: no header, no stop token, nothing a pattern could match."""
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(MarkerDetectionError) as info:
        detect_markers(_with_template(template))
    assert "pass markers yourself" in str(info.value)


def test_missing_template_is_a_detection_error():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path("chatml")))
    hf.chat_template = None
    with pytest.raises(MarkerDetectionError, match="no chat template"):
        detect_markers(hf)


def test_detect_accepts_a_path():
    markers = detect_markers(tokenizer_path("phi-4"))
    ct = chat_tokenizer("phi-4")
    assert decoded(ct, markers.response) == {"<|im_start|>assistant<|im_sep|>"}
    assert markers == detected_markers("phi-4")[0]


# -- markers_from_strings ------------------------------------------------------------------------


def test_strings_become_in_context_patterns_that_verify():
    ct = chat_tokenizer("qwen2.5")
    markers = markers_from_strings(ct, response="<|im_start|>assistant\n", end=["<|im_end|>"])
    assert isinstance(markers, Markers) and len(markers.response) > 1  # every variant in context
    assert verify(ct, markers).ok


def test_strings_inside_merged_tokens_take_the_covering_tokens():
    """Llama-2 writes ' [/INST]': the '[' only exists as '▁[' in context."""
    ct = chat_tokenizer("llama-2")
    markers = markers_from_strings(ct, response="[/INST]", end="</s>")
    assert all(ct.convert_ids_to_tokens(p)[-3:] == ["/", "INST", "]"] for p in markers.response)
    assert any(ct.convert_ids_to_tokens(p)[0] == "▁[" for p in markers.response)
    assert verify(ct, markers).ok


def test_strings_that_never_occur_are_refused():
    ct = chat_tokenizer("qwen2.5")
    with pytest.raises(MarkerDetectionError, match="'<\\|assistant\\|>' does not occur"):
        markers_from_strings(ct, response="<|assistant|>")
    with pytest.raises(TypeError, match="non-empty strings"):
        markers_from_strings(ct, response=[""])


def test_strings_cover_all_four_kinds():
    ct = chat_tokenizer("qwen3")
    markers = markers_from_strings(
        ct, response="<|im_start|>assistant\n", instruction="<|im_start|>user", end="<|im_end|>", mask_out="</think>"
    )
    assert decoded(ct, markers.mask_out) == {"</think>"}
    assert decoded(ct, markers.instruction) == {"<|im_start|>user"}


def test_load_tokenizer_result_is_reused_by_detection():
    ct = load_tokenizer(chat_tokenizer("chatml"))
    assert ct is chat_tokenizer("chatml")
    assert detect_markers(ct) == detect_markers(ct)


def test_detection_notes_what_users_should_know():
    _, glm = detected_markers("glm-4")
    assert any("have no stop token" in note for note in glm.notes) and "note:" in str(glm)
    _, alpaca = detected_markers("alpaca")
    assert any("plain text ('### Response:')" in note for note in alpaca.notes)
    _, qwen = detected_markers("qwen3")
    assert qwen.notes == ()


def test_qwen3_non_thinking_masks_the_prompt_prefill():
    """enable_thinking=False: the generation prompt writes '<think>\\n\\n</think>\\n\\n', which only the
    last turn contains; it is never trained there, and earlier turns train from their content."""
    from test_conformance import random_conversations
    from test_verify import trained_spans
    from lossmask.verify import ground_truth

    ct = load_tokenizer(chat_tokenizer("qwen3"), template_kwargs={"enable_thinking": False})
    markers, report = detect_markers_with_report(ct)
    assert report.ok and decoded(ct, markers.mask_out) == {"<think>", "\n\n</think>\n\n"}
    assert any("mask_out" in note for note in report.notes)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]
    assert trained_spans(ground_truth(ct, chat)) == ["Hello.<|im_end|>", "Goodbye.<|im_end|>"]
    assert verify(ct, markers, random_conversations(seed=7, count=10)).ok


def test_glm_non_thinking_with_reasoning_is_refused():
    """GLM with enable_thinking=False puts '<think></think>' in the prompt; a reasoning turn then
    shares only '<think>' with it, and no markers can open both kinds of turn right."""
    ct = load_tokenizer(chat_tokenizer("glm-4"), template_kwargs={"enable_thinking": False})
    with pytest.raises(MarkerDetectionError, match="do not reproduce its ground truth"):
        detect_markers(ct)


def test_named_templates_render_tools_with_their_own_template():
    """A tokenizer with {'default', 'tool_use'} templates: probes with tools use 'tool_use'."""
    base = chat_tokenizer("qwen2.5")
    template = base.template_for()
    tool_use = template.replace("# Tools", "# Tool box")  # same markers, visibly another template
    ct = ChatTokenizer(base.tokenizer, chat_template={"default": template, "tool_use": tool_use}, name="named")
    markers, report = detect_markers_with_report(ct)
    assert report.ok and markers == detected_markers("qwen2.5")[0]
    tool = next(c for c in report.conversations if c.name == "tool")
    assert "# Tool box" in tool.truth.text


def test_end_of_turn_token_added_without_the_special_flag():
    """Community ChatML fine-tunes often add <|im_start|>/<|im_end|> as plain added tokens (EOS </s>):
    <|im_end|> still ends the turn, so it is still the trained stop token."""
    import json

    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from test_conformance import random_conversations

    folder = tokenizer_path("chatml")
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    for token in data["added_tokens"]:
        if token["content"] in ("<|im_start|>", "<|im_end|>"):
            token["special"] = False
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    template = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    ct = ChatTokenizer(hf, chat_template=template, name="chatml, plain added tokens")
    assert hf.convert_tokens_to_ids("<|im_end|>") not in ct.special_ids
    markers, report = detect_markers_with_report(ct)
    assert report.ok and decoded(ct, markers.end) == {"<|im_end|>"}
    single_turn = [m for m in random_conversations(seed=4, count=12) if len(m) <= 3]
    assert single_turn and verify(ct, markers, single_turn).ok


@pytest.mark.parametrize("family", ["qwen2.5", "olmo-2", "gemma-3"])
def test_vocabulary_whitespace_merges_with_the_header(family):
    """Contents that start with newline + spaces (code), newline runs or tabs: the header's '\\n'
    merges with them into vocabulary tokens the fixed probes never produce."""
    ct = chat_tokenizer(family)
    markers, report = detected_markers(family)
    assert any(c.name.startswith("vocabulary-") for c in report.conversations)
    leads = ["\n" + " " * k for k in range(1, 17)] + ["\n" * k for k in range(1, 12)] + ["\t" * k for k in range(1, 6)]
    chats = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": f"{lead}x = 1"}] for lead in leads]
    assert verify(ct, markers, chats).ok
