"""detect_markers on real templates and on templates that cannot be analysed; markers_from_strings."""

from __future__ import annotations

import sys

import pytest

from conftest import FIXTURES, chat_tokenizer, detected_markers, tokenizer_path
from lossmask import ChatTokenizer, MarkerDetectionError, Markers, detect_markers, load_tokenizer, markers_from_strings, verify
from lossmask.markers.detect import detect_markers_with_report

sys.path.insert(0, str(FIXTURES))
from loaded_once import folders_loaded_once  # noqa: E402

sys.path.pop(0)


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
        # parallel tool calls: '[/TOOL_RESULTS]' opens the answer and also precedes the next result
        ("mistral-v3", {"[/INST]", "[/TOOL_RESULTS]"}, {"</s>"}, {"[TOOL_RESULTS]"}),
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
    from lossmask.markers.verify import ground_truth

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


# -- tool turns in every argument form, kinds of conversation --------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _tool_chat(arguments, *, parallel: bool = False) -> dict:
    calls = [{"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments("Turku")}}]
    results = [{"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "two degrees"}]
    if parallel:
        calls.append({"id": "call00002", "type": "function", "function": {"name": "get_weather", "arguments": arguments("Pori")}})
        results.append({"role": "tool", "tool_call_id": "call00002", "name": "get_weather", "content": "four degrees"})
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "How cold is it up north?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        *results,
        {"role": "assistant", "content": "Chilly up there."},
    ]}


def _trained_text(ct, markers, chat) -> str:
    from lossmask import make_labels

    ids = ct.encode(ct.render(chat["messages"], tools=chat["tools"]))
    labels = make_labels([ids], markers)[0]
    return "".join(ct.decode([t]) if lab != -100 else "·" for t, lab in zip(ids, labels))


def test_deepseek_v3_trains_the_answer_after_json_string_tool_calls():
    """DeepSeek-V3's template concatenates arguments, so only JSON strings render; the answer after
    the results opens with '<｜tool▁outputs▁end｜>'."""
    import json

    ct = chat_tokenizer("deepseek-v3")
    markers, report = detected_markers("deepseek-v3")
    for parallel in (False, True):
        chat = _tool_chat(lambda city: json.dumps({"city": city}), parallel=parallel)
        assert verify(ct, markers, [chat]).ok
        assert "Chilly up there.<｜end▁of▁sentence｜>" in _trained_text(ct, markers, chat)
    kinds = {kind: (status, detail) for kind, status, detail in report.kinds}
    assert kinds["tools"][0] == "exact" and "arguments as JSON strings" in kinds["tools"][1]
    assert kinds["parallel tools"][0] == "exact"


@pytest.mark.parametrize("family", ["deepseek-v3.1", "mistral-v3", "mistral-nemo", "qwen2.5"])
def test_parallel_tool_results_are_masked(family):
    """DeepSeek-V3.1's '<｜tool▁output▁end｜>' and Mistral's '[/TOOL_RESULTS]' open the answer after tool
    results and also precede the next result: that result must stay masked."""
    ct = chat_tokenizer(family)
    markers, _ = detected_markers(family)
    chat = _tool_chat(lambda city: {"city": city}, parallel=True)
    assert verify(ct, markers, [chat]).ok
    trained = _trained_text(ct, markers, chat)
    assert "four degrees" not in trained and "two degrees" not in trained
    assert "Chilly" in trained


def test_gpt_oss_header_between_analysis_and_final_is_trained_by_the_rule():
    """The model writes '<|start|>assistant' between its analysis and its final message in one
    sampling run: the rule trains it. Markers alone cannot (it is the turn's header, token for token); the
    messages path trains it (its weights join the two trained parts of one assistant message),
    and verify takes those tokens' labels from the messages path, so nothing is beyond the markers."""
    from lossmask.engine.labels import label_batch
    import pyarrow as pa
    from lossmask.markers.verify import ground_truth

    ct = chat_tokenizer("gpt-oss")
    markers, report = detected_markers("gpt-oss")
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "thinking": "Add."}]
    truth = ground_truth(ct, chat)
    copies = [k for k in range(len(truth.ids)) if truth.header_copies[k]]
    assert ct.decode(truth.ids[copies]) == "<|start|>assistant" and truth.should_train[copies].all()
    checked = verify(ct, markers, [chat])
    assert checked.ok and checked.beyond_markers == 0
    assert (checked.conversations[0].labels[copies] != -100).all()
    alone = label_batch(pa.array([truth.ids.tolist()]), markers).labels[0].as_py()
    assert all(alone[k] == -100 for k in copies)  # the marker rule alone leaves them out
    assert report.ok and report.beyond_markers == 0


KIND_EXPECTATIONS = {
    # family: {kind: status}, from what each template can render
    "deepseek-v3": {"tools": "exact", "parallel tools": "exact", "reasoning": "not rendered"},
    "deepseek-v3.1": {"tools": "exact", "parallel tools": "exact"},
    "gpt-oss": {"tools": "exact", "parallel tools": "not rendered", "reasoning": "exact"},
    "llama-3.1": {"tools": "exact", "parallel tools": "not rendered"},
    "phi-3": {"system": "not rendered", "tools": "not rendered"},
    "mistral-v3": {"system": "not rendered", "tools": "exact", "parallel tools": "exact"},
    "gemma-2": {"system": "not rendered", "tools": "not rendered"},
    "qwen3": {"plain": "exact", "system": "exact", "multi-turn": "exact", "tools": "exact",
              "parallel tools": "exact", "reasoning": "exact"},
}


@pytest.mark.parametrize("family", sorted(KIND_EXPECTATIONS))
def test_detection_reports_each_kind_of_conversation(family):
    _, report = detected_markers(family)
    kinds = {kind: status for kind, status, _ in report.kinds}
    assert set(kinds) == {"plain", "system", "multi-turn", "tools", "parallel tools", "reasoning"}
    for kind, status in KIND_EXPECTATIONS[family].items():
        assert kinds[kind] == status, (kind, report.kinds)
    assert kinds["plain"] == kinds["multi-turn"] == "exact"


def test_mistral_v3_system_prompt_is_reported_as_dropped():
    """Mistral v3 writes the system prompt only before the last user message: a chat ending with an
    assistant turn loses it, and detection says which message went missing."""
    _, report = detected_markers("mistral-v3")
    detail = dict((kind, detail) for kind, _, detail in report.kinds)["system"]
    assert "message 0 (system)" in detail


def test_a_rendered_kind_that_is_not_exact_is_refused():
    """A template that writes tool results inside an assistant block: plain chats verify, the tool
    probes cannot, so detection refuses rather than return markers that train tool output."""
    template = (
        "{% for m in messages %}"
        "{% if m['role'] == 'tool' %}<|im_start|>assistant\nRESULT {{ m['content'] }}<|im_end|>\n"
        "{% elif m.get('tool_calls') %}<|im_start|>assistant\n{% for c in m['tool_calls'] %}CALL "
        "{{ c['function']['name'] }} {{ c['function']['arguments'] | tojson }}{% endfor %}<|im_end|>\n"
        "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(MarkerDetectionError, match="tool"):
        detect_markers(_with_template(template))


def test_lossmask_detect_prints_the_kinds(capsys):
    from lossmask.cli import main

    with folders_loaded_once("deepseek-v3"):  # the folder answered by the tokenizer loaded once per test run
        assert main(["detect", str(tokenizer_path("deepseek-v3"))]) == 0
    out = capsys.readouterr().out
    assert "conversation kinds:" in out
    assert "parallel tools  exact: arguments as JSON strings" in out
    assert "reasoning       not rendered" in out


def test_lossmask_detect_json_lists_the_kinds(capsys):
    import json

    from lossmask.cli import main

    with folders_loaded_once("phi-3"):
        assert main(["detect", str(tokenizer_path("phi-3")), "--json"]) == 0
    kinds = {k["kind"]: k for k in json.loads(capsys.readouterr().out)["verification"]["kinds"]}
    assert kinds["system"]["status"] == "not rendered" and "message 0 (system)" in kinds["system"]["detail"]
    assert kinds["plain"]["status"] == "exact"
