"""Chat templates that cannot run away render without the per-operation checks; those that can are bounded.

``chat.template_bounds`` reads a template's parsed nodes once. Every real template of the 27 families
is of the kind whose work the chat's size bounds, and renders in transformers' own sandbox: the same text,
bit for bit, as the checked sandbox and as transformers' unbounded render. A template with loops that
never end (nested constant ranges) is refused at once on every path; one whose loops grow with a number
it computes is held to ``MAX_RENDER_STEPS`` loop turns and calls per row, also in loops that write nothing.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

import lossmask
from conftest import chat_tokenizer, tokenizer_families, tokenizer_path
from lossmask.chat import render
from lossmask.chat.render import RenderLimitError, bounded_template, compile_template, render_bounded
from lossmask.chat.template_bounds import runaway_reason

from test_render import _chats

ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROWING = "{% for i in range(messages | length * 50000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def _environment():
    return render._reference_environment()  # noqa: SLF001


@pytest.mark.parametrize("family", tokenizer_families())
def test_every_real_template_takes_the_unchecked_path_and_renders_the_same_text(family):
    ct = chat_tokenizer(family)
    template = ct.template_for()
    assert runaway_reason(template, _environment()) is None
    fast, checked = bounded_template(template), compile_template(template, checked=True)
    assert type(fast).__name__ == "SizedTemplate"
    reference = render._transformers_compile()(template)  # noqa: SLF001 - transformers' own, unbounded
    variables = {**ct.tokenizer.special_tokens_map, **ct.template_kwargs, "add_generation_prompt": False}
    rendered = 0
    for chat in _chats():
        messages = render.text_parts(chat) if ct.renders_parts_only else chat
        texts = []
        for template_object in (fast, checked):
            try:
                texts.append(render_bounded(template_object, messages=messages, **variables))
            except Exception as exc:  # noqa: BLE001 - both must refuse alike
                texts.append((type(exc).__name__, str(exc)))
        try:
            texts.append(reference.render(messages=messages, **variables))
        except Exception as exc:  # noqa: BLE001
            texts.append((type(exc).__name__, str(exc)))
        assert texts[0] == texts[1] == texts[2]
        rendered += isinstance(texts[0], str)
    assert rendered >= 3


@pytest.mark.parametrize("template, why", [
    (ENDLESS, "range with a bound that is not small"),
    (GROWING, "range with a bound that is not small"),
    ("{{ 'x' * 10**9 }}", "repeats a value"),
    ("{% set ns = namespace(s='a') %}{% for m in messages %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "builds ns.s from itself twice"),
    ("{% macro f(x) %}{{ f(x) }}{{ f(x) }}{% endmacro %}{{ f(1) }}", "the macro f calls f again"),
    ("{{ 'x' | center(10**9) }}", "the filter center takes a size"),
    ("{{ 'x'.ljust(messages | length * 10**8) }}", "the method ljust"),
    ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
     "nests 3 loops"),
    ("{% for m in messages recursive %}{{ loop(m.children) }}{% endfor %}", "recursive loop"),
    ("{{ lipsum(10**9) }}", "calls lipsum"),
])
def test_templates_that_could_run_away_keep_the_checked_sandbox(template, why):
    assert why in (runaway_reason(template, _environment()) or "")


def test_loops_over_parts_of_an_item_and_structural_recursion_are_bounded():
    walks_parts = ("{% for m in messages %}{% for call in m.tool_calls %}{% set args = call.arguments %}"
                   "{% for k, v in args.items() %}{{ k }}{% endfor %}{% endfor %}{% endfor %}")
    schema = ("{% macro show(spec) %}{% for name, sub in spec.properties.items() %}{{ name }}{{ show(sub) }}"
              "{% endfor %}{{ show(spec['items']) if spec['items'] }}{% endmacro %}"
              "{% for tool in tools %}{{ show(tool.parameters) }}{% endfor %}{{ '-' * 80 }}{{ range(3) | join }}")
    for template in (walks_parts, schema):
        assert runaway_reason(template, _environment()) is None, template


def _hostile(template):
    from lossmask.chat.tokenizer import ChatTokenizer

    base = chat_tokenizer("qwen2.5")
    return base, ChatTokenizer(base.tokenizer, chat_template=template + base.template_for(), name="hostile")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


def test_a_template_whose_loops_never_end_is_refused_at_once_on_every_path(tmp_path, capsys):
    from lossmask.cli import main
    from lossmask.markers.detect import detect_markers

    base, ct = _hostile(ENDLESS)
    started = time.monotonic()
    with pytest.raises(RenderLimitError, match=r"loops 10,000,000,000 times whatever the chat \(range\(100000\)"):
        bounded_template(ct.template_for())
    encoded = ct.encode_chats([CHAT])
    (row, why), = encoded.errors
    assert row == 0 and "MAX_RENDER_STEPS" in why
    with pytest.raises(Exception, match="renders none of the probe conversations"):
        detect_markers(ct)
    folder = tmp_path / "tok"  # `lossmask detect` and `lossmask mask --chat-template` on the same template
    shutil.copytree(tokenizer_path("qwen2.5"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = ct.template_for()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["detect", str(folder)]) == 1
    (tmp_path / "endless.jinja").write_text(ct.template_for())
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    capsys.readouterr()
    for source in (["--chat-template", str(tmp_path / "endless.jinja")], []):  # given, or in the tokenizer's folder
        tokenizer = str(tokenizer_path("qwen2.5") if source else folder)
        code = main(["mask", str(tmp_path / "chats.jsonl"), str(tmp_path / "out.parquet"), "--tokenizer", tokenizer,
                     *source, "--no-progress", "--max-drop-fraction", "1"])
        err = capsys.readouterr().err
        assert code == 1 and not (tmp_path / "out.parquet").exists()
        # one line, before any marker is looked for (no full-sequence warning ahead of it)
        assert err.count("\n") == 1 and "loops 10,000,000,000 times whatever the chat" in err, err
    with pytest.raises(RenderLimitError, match="whatever the chat"):  # and through load_tokenizer
        lossmask.load_tokenizer(folder).check_templates()
    assert time.monotonic() - started < 120  # each path ends at once: never a render run to a bound


def test_loops_that_grow_with_the_chat_stop_at_the_step_bound_even_when_they_write_nothing(monkeypatch):
    monkeypatch.setattr(render, "MAX_RENDER_SECONDS", 600.0)  # the step bound alone must end it
    base, ct = _hostile(GROWING)
    started = time.monotonic()
    with pytest.raises(RenderLimitError, match=r"render over 1,048,576 loop turns and calls \(MAX_RENDER_STEPS\)"):
        ct.render(CHAT)
    encoded = ct.encode_chats([CHAT])
    (row, why), = encoded.errors
    assert row == 0 and "MAX_RENDER_STEPS" in why
    assert time.monotonic() - started < 60
