"""ChatTokenizer: what it accepts, how it renders and encodes (as training does), batch encoding."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pytest

from conftest import chat_tokenizer, tokenizer_path
from lossmask.chat.tokenizer import ChatTemplateError, ChatTokenizer, EncodedChats, load_tokenizer

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Spain?"},
    {"role": "assistant", "content": "Madrid."},
]


def _hf(family: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(family)))


def test_import_lossmask_pulls_no_heavy_dependency():
    code = (
        "import sys, lossmask\n"
        "heavy = [m for m in ('transformers', 'torch', 'mlx', 'ray', 'datasets', 'trl', 'jinja2', 'tokenizers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert lossmask.load_tokenizer and lossmask.detect_markers and lossmask.verify\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_from_path_and_from_tokenizer_agree():
    from_path = chat_tokenizer("qwen2.5")
    from_object = load_tokenizer(_hf("qwen2.5"))
    assert isinstance(from_path, ChatTokenizer) and load_tokenizer(from_path) is from_path
    assert from_path.render(CHAT) == from_object.render(CHAT)
    assert from_path.encode(from_path.render(CHAT)) == from_object.encode(from_object.render(CHAT))


def test_a_tokenizer_only_folder_naming_the_generic_class_loads_as_auto_tokenizer_would_without_torch(tmp_path):
    """A tokenizer-only folder whose config names ``PreTrainedTokenizerFast`` is loaded by that class, as
    ``AutoTokenizer`` would load it (the same class, pipeline, template and special tokens) but without the torch
    import that ``AutoTokenizer`` brings; a folder naming a model's own class, or holding a model's config, still
    goes through ``AutoTokenizer``."""
    import json
    import shutil

    from conftest import tokenizer_families
    from lossmask.chat.tokenizer import _names_the_generic_class, auto_tokenizer

    # one of each kind of pipeline: byte-level BPE, SentencePiece with Metaspace or ByteFallback, a Punctuation split
    kinds = ("qwen2.5", "llama-2", "gemma-3", "mistral-v3", "falcon")
    for family in [f for f in tokenizer_families() if f in kinds]:
        path = str(tokenizer_path(family))
        if not _names_the_generic_class(path):
            continue
        direct, auto = auto_tokenizer(path), _hf(family)
        assert type(direct) is type(auto), family
        assert direct.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str(), family
        assert (direct.chat_template, direct.special_tokens_map, direct.added_tokens_decoder) == \
            (auto.chat_template, auto.special_tokens_map, auto.added_tokens_decoder), family
    own_class = tmp_path / "own-class"
    shutil.copytree(tokenizer_path("qwen2.5"), own_class)
    config = json.loads((own_class / "tokenizer_config.json").read_text())
    (own_class / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert not _names_the_generic_class(str(own_class))
    with_model = tmp_path / "with-model"  # transformers may swap the declared class for the model type's own
    shutil.copytree(tokenizer_path("qwen2.5"), with_model)
    (with_model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not _names_the_generic_class(str(with_model))
    assert auto_tokenizer(str(own_class)).encode("Hello") == _hf("qwen2.5").encode("Hello")
    code = (f"import sys; from lossmask import load_tokenizer; load_tokenizer({str(tokenizer_path('qwen2.5'))!r}); "
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


def test_load_from_missing_path_says_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_unsupported_object_is_a_type_error():
    with pytest.raises(TypeError, match="fast tokenizer, a processor"):
        load_tokenizer(42)


def test_mlx_lm_wrapper_uses_the_inner_tokenizer():
    tokenizer_utils = pytest.importorskip("mlx_lm.tokenizer_utils")
    hf = _hf("qwen2.5")
    ct = load_tokenizer(tokenizer_utils.TokenizerWrapper(hf))
    assert ct.tokenizer is hf


class _Processor:
    """A stand-in for a transformers processor: a template of its own, ids from .tokenizer."""

    def __init__(self, tokenizer, chat_template):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def apply_chat_template(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError("lossmask renders with the processor's template through its tokenizer")


def test_processor_template_renders_and_tokenizer_encodes():
    hf = _hf("chatml")
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    ct = load_tokenizer(_Processor(hf, template))
    assert ct.tokenizer is hf
    assert ct.render(CHAT[:2]) == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n"


def test_named_templates_list_and_dict():
    hf = _hf("chatml")
    named = [{"name": "default", "template": "D{{ messages[0]['content'] }}"}, {"name": "tool_use", "template": "T{{ tools[0]['name'] }}"}]
    ct = ChatTokenizer(hf, chat_template=named)
    assert ct.templates == {"default": "D{{ messages[0]['content'] }}", "tool_use": "T{{ tools[0]['name'] }}"}
    assert ct.render([{"role": "user", "content": "x"}]) == "Dx"
    assert ct.render([{"role": "user", "content": "x"}], tools=[{"name": "f"}]) == "Tf"
    assert ChatTokenizer(hf, chat_template=named, template_name="tool_use").template_for() == named[1]["template"]
    with pytest.raises(ValueError, match="no chat template named 'nope'"):
        ChatTokenizer(hf, chat_template=named, template_name="nope")
    with pytest.raises(ChatTemplateError, match="none is 'default'"):
        ChatTokenizer(hf, chat_template={"a": "x"}).render([{"role": "user", "content": "x"}])


def test_no_chat_template_is_a_clear_error():
    hf = _hf("chatml")
    hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        load_tokenizer(hf)


@pytest.mark.parametrize("family", ["llama-2", "gemma-3", "qwen2.5", "zephyr"])
def test_encoding_matches_apply_chat_template_tokenize(family):
    """Ids are what transformers/TRL train on: the template's BOS once, nothing added on top."""
    hf = _hf(family)
    ct = load_tokenizer(hf)
    expected = hf.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ct.encode(ct.render(CHAT)) == list(expected)
    if hf.bos_token_id is not None:
        assert ct.encode(ct.render(CHAT))[:2].count(hf.bos_token_id) <= 1


def test_offsets_point_into_the_text():
    ct = chat_tokenizer("llama-3")
    text = ct.render(CHAT)
    ids, offsets = ct.encode_with_offsets(text)
    assert len(ids) == len(offsets) and offsets[-1, 1] == len(text)
    assert text[offsets[0, 0] : offsets[0, 1]] == "<|begin_of_text|>"
    assert "".join(text[a:b] for a, b in offsets) == text  # llama-3 offsets tile the text


def test_template_errors_are_chat_template_errors():
    ct = chat_tokenizer("gemma-2")
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        ct.render([{"role": "system", "content": "s"}, *CHAT])


def test_encode_chats_rows_errors_and_truncation():
    ct = chat_tokenizer("gemma-2")
    rows = [
        CHAT,
        [{"role": "system", "content": "no system on gemma-2"}, *CHAT],  # the template raises
        {"messages": CHAT[:2]},
        {"no": "messages"},
    ]
    result = ct.encode_chats(rows)
    assert isinstance(result, EncodedChats)
    assert result.input_ids.type == pa.large_list(pa.int32())
    assert result.input_ids.to_pylist()[0] == ct.encode(ct.render(CHAT))
    assert result.input_ids.to_pylist()[2] == ct.encode(ct.render(CHAT[:2]))
    assert result.input_ids.null_count == 2 and result.ok.tolist() == [True, False, True, False]
    assert [row for row, _ in result.errors] == [1, 3]
    assert "row 1" in result.errors[0][1] and "System role not supported" in result.errors[0][1]
    short = ct.encode_chats(rows[:1], max_length=5)
    assert short.input_ids.to_pylist() == [ct.encode(ct.render(CHAT))[:5]] and short.errors == ()
    assert len(ct.encode_chats([]).input_ids) == 0
    with pytest.raises(ValueError, match="max_length"):
        ct.encode_chats(rows, max_length=0)


def test_encode_chats_with_tools_and_generation_prompt():
    ct = chat_tokenizer("qwen2.5")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
    result = ct.encode_chats([CHAT[:1]], tools=tools, add_generation_prompt=True)
    expected = ct.encode(ct.render(CHAT[:1], tools=tools, add_generation_prompt=True))
    assert result.input_ids.to_pylist() == [expected]
    assert ct.decode(expected).endswith("<|im_start|>assistant\n") and "get_weather" in ct.decode(expected)


def test_template_kwargs_reach_every_render():
    base = chat_tokenizer("qwen3")
    ct = load_tokenizer(base, template_kwargs={"enable_thinking": False})
    assert ct is not base and base.template_kwargs == {} and ct.tokenizer is base.tokenizer
    assert ct.render(CHAT[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert base.render(CHAT[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    assert ct.encode_chats([CHAT[:1]], add_generation_prompt=True).input_ids.to_pylist()[0] == ct.encode(
        ct.render(CHAT[:1], add_generation_prompt=True)
    )


def test_encode_chats_all_rejected_and_generators():
    ct = chat_tokenizer("gemma-2")
    rejected = ct.encode_chats([[{"role": "system", "content": "x"}], {"nope": 1}])
    assert rejected.input_ids.to_pylist() == [None, None] and [r for r, _ in rejected.errors] == [0, 1]
    rows = iter([CHAT[:1]])
    assert ct.encode_chats(rows).input_ids.to_pylist() == [ct.encode(ct.render(CHAT[:1]))]
