"""Every render runs under one budget: steps, characters built, rendered text and wall time.

Templates that can run away, each gated on a row's text as a hostile template would be: they pass or fail the
bounds analysis (``template_bounds``), and either way they are stopped by the budget. In a process capped well
under 1 GiB they end in a fraction of the 5-second clock with ``RenderLimitError`` naming the bound; through
``mask_files``, ``hf.mask_dataset`` and the mlx feed the row that runs away is invalid (named), the others are
written; a template that goes over the budget on the set-up probe is refused in one line before any row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import chat_tokenizer, tokenizer_path

GATE = "{% if 'BOOM' in messages[0].content %}TEMPLATE{% endif %}"
RUNAWAY = {  # what each builds or how long it loops, and the bound that stops it
    "a macro calling itself twice on a part": (
        "{% macro f(x) %}{% if x %}{{ f(x[1:]) }}{{ f(x[1:]) }}{% endif %}{% endmacro %}{{ f(messages[0].content[:40]) }}",
        "MAX_RENDER_S"),  # STEPS or SECONDS, whichever a slow machine meets first
    "the same macro doubling a second argument": (
        "{% macro f(x, y) %}{% if x %}{{ f(x[1:], y ~ y) }}{{ f(x[1:], y ~ y) }}{% endif %}{% endmacro %}"
        "{{ f(messages[0].content[:40], 'ab') }}", "MAX_RENDER_CHARS"),
    "a namespace string doubled through a temporary": (
        "{% set ns = namespace(s=messages[0].content) %}{% for i in range(60) %}{% set t = ns.s %}"
        "{% set ns.s = t ~ ns.s %}{% endfor %}", "MAX_RENDER_CHARS"),
    "a namespace string doubled through a block set": (
        "{% set ns = namespace(s=messages[0].content) %}{% for i in range(60) %}{% set t %}{{ ns.s }}{{ ns.s }}"
        "{% endset %}{% set ns.s = t %}{% endfor %}", "MAX_RENDER_CHARS"),
    "a join squared twice": (
        "{% set a = messages[0].content %}{% set b = a.join(a) %}{{ b.join(b) | length }}", "MAX_RENDER_CHARS"),
    "a replace squared twice": (
        "{% set a = messages[0].content %}{% set b = a.replace('', a) %}{{ b.replace('', b) | length }}",
        "MAX_RENDER_CHARS"),
    "the join filter squared twice": (
        "{% set a = messages[0].content | list %}{% set b = a | join(messages[0].content) %}"
        "{{ b | list | join(b) | length }}", "MAX_RENDER_CHARS"),
    "two nested loops over a long message": (
        "{% for a in messages[0].content * 1000 %}{% for b in messages[0].content * 1000 %}{% endfor %}{% endfor %}",
        "MAX_RENDER_STEPS"),
    "lipsum of nine million paragraphs": ("{{ lipsum(9000000) }}", "MAX_RENDER_CHARS"),
    "a width taken from the chat": ("{{ '%*s' % (messages[0].content | length * 1000000, 'x') }}",
                                    "MAX_RENDER_CHARS"),
    "one value written a million times": (
        "{% set big = messages[0].content * 100000 %}{% for i in range(10000) %}{{ big }}{% endfor %}",
        "MAX_RENDER_CHARS"),
}
BOOM = "BOOM " + "x" * 207  # a 212-character message
CAP = 768 * 2**20  # bytes of address space for the capped process


def _hostile_template(body: str) -> str:
    return GATE.replace("TEMPLATE", body) + chat_tokenizer("qwen2.5").template_for()


def test_runaway_templates_stop_at_the_budget_in_a_capped_process():
    cases = {name: _hostile_template(body) for name, (body, _) in RUNAWAY.items()}
    script = textwrap.dedent(f"""
        import json, resource, sys, time
        resource.setrlimit(resource.RLIMIT_AS, ({CAP}, {CAP}))
        from lossmask.chat import render
        cases = json.loads(sys.stdin.read())
        for name, template in cases.items():
            for compiled in (render.bounded_template(template), render.compile_template(template, checked=True)):
                started = time.monotonic()
                try:
                    render.render_bounded(compiled, messages=[{{"role": "user", "content": {BOOM!r}}}])
                    outcome = "rendered"
                except render.RenderLimitError as exc:
                    outcome = str(exc)
                print(json.dumps([name, outcome, time.monotonic() - started]), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=10 * len(cases))
    assert done.returncode == 0, done.stderr[-2000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 2 * len(RUNAWAY)
    for name, outcome, seconds in results:
        assert RUNAWAY[name][1] in outcome, (name, outcome)
        assert seconds < 10, (name, seconds)


def test_the_budget_holds_templates_that_the_analysis_lets_through():
    from lossmask.chat import render
    from lossmask.chat.template_bounds import runaway_reason

    passed = [name for name, (body, _) in RUNAWAY.items()
              if runaway_reason(_hostile_template(body), render._reference_environment()) is None]  # noqa: SLF001
    # the analysis is a speed choice, not the bound: these reach the fast sandbox, which the capped test holds too
    assert {"a macro calling itself twice on a part", "a join squared twice", "a replace squared twice"} <= set(passed)


def _rows(tmp_path, boom: str = BOOM):
    chats = [[{"role": "user", "content": f"question {k}"}, {"role": "assistant", "content": f"answer {k}"}]
             for k in range(8)]
    chats[3][0]["content"] = boom
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    return path, chats


@pytest.mark.parametrize("name", ["a macro calling itself twice on a part", "a join squared twice",
                                  "lipsum of nine million paragraphs"])
def test_a_row_that_runs_away_is_invalid_naming_the_bound_on_every_job_path(name, tmp_path):
    import lossmask
    from lossmask.chat.tokenizer import ChatTokenizer
    from lossmask.hf import mask_dataset
    from lossmask.mlx import load_dataset

    body, bound = RUNAWAY[name]
    ct = ChatTokenizer(chat_tokenizer("qwen2.5").tokenizer, chat_template=_hostile_template(body), name="hostile")
    path, chats = _rows(tmp_path)
    report = lossmask.mask_files(path, tmp_path / "out.parquet", tokenizer=ct, max_drop_fraction=1.0)
    assert (report.rows_in, report.rows_out) == (8, 7)
    (example,) = report.invalid_examples
    assert "row 3" in example and "chats.jsonl" in example and bound[:14] in example, example

    datasets = pytest.importorskip("datasets")
    out, report = mask_dataset(datasets.Dataset.from_list([{"messages": c} for c in chats]), ct,
                                  return_report=True, max_drop_fraction=1.0)
    assert len(out) == 7 and report.dropped["invalid"] == 1

    folder = tmp_path / "mlx"
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text(path.read_text())
    with pytest.raises(ValueError, match=rf"1 rows could not be rendered by the chat template; first: .*{bound[:14]}"):
        load_dataset(folder, ct)


@pytest.mark.parametrize("head, why", [
    ("{% for i in range(messages | length + 9999) %}{% for j in range(messages | length + 9999) %}{% endfor %}"
     "{% endfor %}", "goes over the render budget on a two-message chat (render over 1,048,576 loop turns"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "does what the sandbox refuses on a two-message chat"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "loops 10,000,000,000 times whatever the chat"),
], ids=["budget", "sandbox", "endless"])
def test_a_template_refused_at_set_up_is_one_line_naming_the_template_file(head, why, tmp_path, capsys):
    from lossmask.cli import main

    (tmp_path / "bad.jinja").write_text(head + chat_tokenizer("qwen2.5").template_for())
    path, _ = _rows(tmp_path, boom="hello")
    capsys.readouterr()
    code = main(["mask", str(path), str(tmp_path / "out.parquet"), "--tokenizer", str(tokenizer_path("qwen2.5")),
                 "--chat-template", str(tmp_path / "bad.jinja"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err  # no full-sequence warning ahead of it
    assert err.startswith(f"lossmask mask: error: {tmp_path / 'bad.jinja'}: ") and why in err, err
    assert sorted(os.listdir(tmp_path)) == ["bad.jinja", "chats.jsonl"]
