"""``lossmask show`` and ``lossmask detect``: what trains, as text, colours and HTML, on real tokenizers."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from functools import lru_cache
from html.parser import HTMLParser

import numpy as np
import pytest

from conftest import chat_tokenizer, tokenizer_path
from lossmask import Markers, Resolution
from lossmask.cli import main
from lossmask.show import format_text, label_conversation, print_shown, to_html, token_pieces

FAMILIES = ["qwen3", "llama-3.1", "gpt-oss", "glm-4", "gemma-3", "mistral-v3"]

# what each family trains last: the last assistant turn through its stop token
LAST_TURN = {
    "qwen3": "<think>\n\n</think>\n\nIt is -3 °C and snowing. Wrap up warm!<|im_end|>",
    "llama-3.1": "It is -3 °C and snowing. Wrap up warm!<|eot_id|>",
    "gpt-oss": "<|channel|>final<|message|>It is -3 °C and snowing. Wrap up warm!<|return|>",
    "glm-4": "\n<think></think>\nIt is -3 °C and snowing. Wrap up warm!",
    "gemma-3": "It is -3 °C and snowing. Wrap up warm!<end_of_turn>",
    "mistral-v3": " It is -3 °C and snowing. Wrap up warm!</s>",
}


def trained_runs(shown) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    runs, current = [], None
    for piece, trained in zip(shown.pieces, shown.trained.tolist()):
        if trained:
            current = (current or "") + piece
        elif current is not None:
            runs.append(current)
            current = None
    if current is not None:
        runs.append(current)
    return runs


def test_token_pieces_join_to_the_text():
    text = "ab€cd"
    offsets = np.array([[0, 1], [1, 2], [2, 3], [2, 3], [4, 5]])  # a split character, then a gap before 'd'
    pieces = token_pieces(text, offsets)
    assert pieces == ("a", "b", "€", "", "cd")
    assert "".join(token_pieces("xyz!", np.array([[0, 2]]))) == "xyz!"
    assert token_pieces("", np.zeros((0, 2), dtype=np.int64)) == ()


@lru_cache(maxsize=None)
def sample(family: str):
    return label_conversation(chat_tokenizer(family))


@pytest.fixture(scope="module", params=FAMILIES)
def shown(request):
    return request.param, sample(request.param)


def test_sample_trains_assistant_turns_only(shown):
    family, s = shown
    assert "".join(s.pieces) == s.text and len(s.pieces) == len(s.ids) == len(s.trained)
    assert s.resolution.source == "detected"
    runs = trained_runs(s)
    assert runs[-1] == LAST_TURN[family]
    assert any(run.endswith(("Paris.", "Paris.<|im_end|>", "Paris.<|eot_id|>", "Paris.<|end|>", "Paris.<|user|>",
                             "Paris.<end_of_turn>", "Paris.</s>")) for run in runs), runs
    for masked in ("You are a concise assistant.", "What is the capital of France?", "minus three, snowing", "Use the tool."):
        assert not any(masked in run for run in runs), (masked, runs)
    text = format_text(s)
    assert f"{s.n_trained} of {len(s.ids)} tokens trained" in text and f"[{runs[-1]}]" in text


def test_tool_call_trains_where_the_template_renders_tools():
    s = label_conversation(chat_tokenizer("qwen2.5"))
    text = format_text(s)
    assert '[<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>]' in text
    assert "[<tool_response>" not in text and "minus three" in text and not s.notes


def test_template_without_tools_gets_the_sample_without_tool_turns():
    s = sample("gemma-3")
    assert s.notes and "tool" in s.notes[0] and "get_weather" not in s.text


def test_html_page_is_self_contained_with_a_legend_and_one_box_per_token(shown):
    family, s = shown
    page = to_html(s)
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page
    assert "Legend" in page and "Markers: detected" in page and "response" in page

    class Boxes(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tokens = self.trained = 0

        def handle_starttag(self, tag, attrs):
            classes = (dict(attrs).get("class") or "").split()
            if tag == "span" and "t" in classes:
                self.tokens += 1
                self.trained += "tr" in classes

    boxes = Boxes()
    boxes.feed(page.split('<div class="chat">', 1)[1])
    assert boxes.tokens == len(s.ids) and boxes.trained == s.n_trained


def test_colour_output_uses_ansi_and_plain_output_brackets(shown):
    _, s = shown
    coloured, plain = io.StringIO(), io.StringIO()
    print_shown(s, out=coloured, colour=True)
    print_shown(s, out=plain, colour=False)
    assert "\x1b[30;42m" in coloured.getvalue()  # black on green: trained
    assert "\x1b[" not in plain.getvalue() and f"[{trained_runs(s)[-1]}]" in plain.getvalue()


def test_no_markers_means_everything_trains_and_says_so():
    path = chat_tokenizer("qwen2.5")
    resolution = Resolution(None, "none", ("WARNING: NO LOSS MASKING",), "test")
    s = label_conversation(path, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], resolution=resolution)
    assert s.trained.all()
    page = to_html(s)
    assert "No markers: every token trains." in page and 'class="warn"' in page


def test_given_markers_label_a_given_conversation():
    path = chat_tokenizer("qwen2.5")
    markers = Markers(response=[[151644, 77091, 198]], instruction=[[151644]], end=[[151645]])
    s = label_conversation(path, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
                           resolution=Resolution(markers, "user", (), "test"))
    assert format_text(s).endswith("<|im_start|>assistant\n[yo<|im_end|>]\n")


# -- the commands ----------------------------------------------------------------------------------


def test_cli_show_prints_and_writes_html(tmp_path, capsys):
    path = str(tokenizer_path("qwen3"))
    conversation = tmp_path / "chat.json"
    conversation.write_text(json.dumps([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]))
    assert main(["show", path, str(conversation)]) == 0
    out = capsys.readouterr().out
    assert "markers: detected" in out and "[<think>\n\n</think>\n\n4<|im_end|>]" in out
    page = tmp_path / "out.html"
    assert main(["show", path, "--html", str(page)]) == 0
    assert "wrote" in capsys.readouterr().out and page.read_text().count('class="t') > 100


def test_cli_show_bad_inputs_name_the_problem(tmp_path, capsys):
    path = str(tokenizer_path("qwen3"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["show", path, str(bad)]) == 1
    assert f"{bad}, line 1: not valid JSON" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing-tokenizer")]) == 1
    assert "missing-tokenizer: the folder does not exist" in capsys.readouterr().err  # not "Repo id must be ..."


def test_cli_detect_text_and_json(capsys):
    path = str(tokenizer_path("gpt-oss"))
    assert main(["detect", path]) == 0
    out = capsys.readouterr().out
    assert "source: detected" in out and "'<|return|>'" in out and "[200002]" in out and "verified: exact" in out
    assert main(["detect", path, "--model-name", "openai/gpt-oss-20b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["source"] == "detected" and info["verification"]["ok"] and [200002] in info["markers"]["end"]
    assert "<|return|>" in info["decoded"]["end"]


def test_show_sample_passes_json_string_arguments_where_the_template_needs_them(capsys):
    """DeepSeek-V3's template concatenates tool-call arguments: the sample's tool turn is shown with
    JSON-string arguments, and the answer after the tool result is trained."""
    from conftest import tokenizer_path
    from lossmask.cli import main

    assert main(["show", str(tokenizer_path("deepseek-v3"))]) == 0
    out = capsys.readouterr().out
    assert "JSON strings" in out
    assert "<｜tool▁outputs▁end｜>[It is -3 °C and snowing." in out


# -- lossmask mask --show: long rows -----------------------------------------------------------------------

def _row(lengths, trained_every_other=True):
    """Token texts t0, t1, ... over messages of ``lengths``, every second message trained; and the starts."""
    texts, trained, starts = [], [], []
    for m, n in enumerate(lengths):
        starts.append(len(texts))
        texts += [f"t{len(texts) + k}" for k in range(n)]
        trained += [m % 2 == 1] * n
    return texts, trained, starts


def test_a_short_row_prints_whole_one_line_per_message():
    from lossmask.jobs.display import preview_lines

    texts, trained, starts = _row([3, 2, 4])
    lines, left_out = preview_lines(texts, trained, starts, max_tokens=200)
    assert left_out == 0 and lines == ["t0 t1 t2", "[t3] [t4]", "t5 t6 t7 t8"]


def test_a_long_row_shows_each_message_head_and_tail_and_counts_what_was_left_out():
    from lossmask.jobs.display import preview_lines

    texts, trained, starts = _row([300, 500, 5, 400])
    lines, left_out = preview_lines(texts, trained, starts, max_tokens=200)
    assert len(lines) == 4  # every message boundary is a line start
    shown = sum(line.count("t") for line in lines) - sum(line.count("tokens") for line in lines)
    assert shown + left_out == len(texts) and 190 <= shown <= 210
    for line, (a, b) in zip(lines, zip(starts, starts[1:] + [len(texts)])):
        first, last = (f"[t{a}]", f"[t{b - 1}]") if trained[a] else (f"t{a}", f"t{b - 1}")
        assert line.startswith(first + " ") and line.endswith(" " + last)  # where each message starts and ends
    assert lines[2] == "t800 t801 t802 t803 t804"  # a short message is never cut
    assert re.fullmatch(r"t0 .* t\d+ … (\d+) tokens … t\d+ .* t299", lines[0])
    notes = [int(n.replace(",", "")) for n in re.findall(r"… ([\d,]+) tokens …", "\n".join(lines))]
    assert sum(notes) == left_out


def test_a_row_of_many_messages_keeps_the_first_and_last_and_counts_those_between():
    from lossmask.jobs.display import preview_lines

    texts, trained, starts = _row([30] * 100)
    lines, left_out = preview_lines(texts, trained, starts, max_tokens=80)
    assert lines[0].startswith("t0 ") and lines[-1].endswith(" [t2999]")
    between = [line for line in lines if "messages" in line]
    assert between == ["… 90 messages (2,700 tokens) …"] and len(lines) == 11
    assert left_out == 2700 + 10 * (30 - 8)


def test_message_starts_are_the_headers_and_the_ends_of_replies():
    from lossmask.jobs.display import message_starts

    # system, user (header 7 8), assistant (header 7 9, reply trained), "\n", user (no header: after the reply)
    ids = [1, 2, 7, 8, 3, 7, 9, 4, 5, 10, 6, 3]
    trained = [False] * 7 + [True, True, False, False, False]
    texts = ["s", "s", "<h>", "u", "x", "<h>", "a", "r", "<e>", "\n", "y", "z"]
    assert message_starts(ids, trained, [[7, 8], [7, 9]], texts) == [0, 2, 5, 10]
    assert message_starts(ids, trained, [[7, 8], [7, 9]]) == [0, 2, 5, 9]
    assert message_starts(ids, trained) == [0, 7, 9]  # no markers: where the labels switch


def test_cli_show_prints_long_rows_by_message_within_show_tokens(tmp_path, capsys):
    long_text = " ".join(f"word{k}" for k in range(400))
    chat = [{"role": "user", "content": "Tell me a long story."}, {"role": "assistant", "content": long_text},
            {"role": "user", "content": "Again, please."}, {"role": "assistant", "content": long_text}]
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": chat}) + "\n")
    out = tmp_path / "out.parquet"
    tok = str(tokenizer_path("qwen2.5"))
    assert main(["mask", str(source), str(out), "--tokenizer", tok, "--no-progress", "--show", "1"]) == 0
    shown = capsys.readouterr().out.split("\nfirst row of", 1)[1].splitlines()[1:]
    assert re.fullmatch(r"row 0 \([\d,]+ of [\d,]+ tokens trained; [\d,]+ of them left out where … stands\):", shown[0])
    assert [line.split(" ", 4)[2:4] for line in shown[1:]] == [
        ["<|im_start|>", "system"], ["<|im_start|>", "assistant"], ["<|im_start|>", "user"], ["<|im_start|>", "assistant"]]
    assert sum(line.count(" tokens …") for line in shown) == 2 and all(len(line) < 1500 for line in shown)
    assert main(["mask", str(source), str(out), "--tokenizer", tok, "--no-progress", "--show", "1",
                 "--show-tokens", "0"]) == 0
    whole = capsys.readouterr().out.split("\nfirst row of", 1)[1]
    assert "…" not in whole and whole.count("[ word] [3] [9] [9] [<|im_end|>]") == 2
    assert main(["mask", str(source), str(tmp_path / "other.parquet"), "--tokenizer", tok, "--show", "1",
                 "--show-tokens", "-5"]) == 1
    assert capsys.readouterr().err == ("lossmask mask: error: --show-tokens -5: give a number of tokens, 0 or more (0 "
                                       "prints whole rows)\n")
    assert not (tmp_path / "other.parquet").exists()



def test_cli_show_loads_the_tokenizer_once_for_the_job_and_the_preview(tmp_path, capsys, monkeypatch):
    import lossmask.chat.tokenizer as tokenizer_module

    loads = []
    real = tokenizer_module.auto_tokenizer

    def counting(path):
        loads.append(path)
        return real(path)

    monkeypatch.setattr(tokenizer_module, "auto_tokenizer", counting)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}]}) + "\n")
    tok = str(tokenizer_path("qwen2.5"))
    assert main(["mask", str(source), str(tmp_path / "out.parquet"), "--tokenizer", tok, "--no-progress",
                 "--show", "1"]) == 0
    assert "[Hello] [.]" in capsys.readouterr().out and loads == [tok]


def test_show_reuses_the_markers_a_job_or_an_earlier_show_resolved(tmp_path, capsys, monkeypatch):
    import lossmask.show as show_module

    monkeypatch.setenv("LOSSMASK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LOSSMASK_CACHE", raising=False)
    resolved = []
    real = show_module.resolve_markers

    def counting(*args, **kwargs):
        resolved.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(show_module, "resolve_markers", counting)
    tok = str(tokenizer_path("llama-3.2"))
    assert main(["show", tok]) == 0 and len(resolved) == 1
    first = capsys.readouterr().out
    assert main(["show", tok]) == 0 and len(resolved) == 1  # the stored resolution: no detection
    assert capsys.readouterr().out == first
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": CHAT}) + "\n")
    other = str(tokenizer_path("phi-3"))
    assert main(["mask", str(source), str(tmp_path / "out.parquet"), "--tokenizer", other, "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["show", other, str(source)]) == 0 and len(resolved) == 1  # what the job resolved
    assert "[Paris." in capsys.readouterr().out

# -- lossmask show reads what lossmask mask reads -------------------------------------------------------------

CHAT = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
SHAREGPT = [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]


def _chat_forms(folder):
    """The same chat in each form lossmask mask reads, as ``(file, extra arguments)``."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    other = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    forms = {
        "messages.json": json.dumps({"messages": CHAT}),
        "list.json": json.dumps(CHAT),
        "sharegpt.json": json.dumps({"id": "x", "conversations": SHAREGPT}, indent=1),
        "sharegpt-list.json": json.dumps(SHAREGPT),
        "pairs.json": json.dumps({"prompt": CHAT[:1], "completion": CHAT[1:]}),
        "rows.jsonl": json.dumps(other) + "\n" + json.dumps({"messages": CHAT}) + "\n",
        "rows-array.json": json.dumps([other, {"messages": CHAT}]),
    }
    out = []
    for name, text in forms.items():
        (folder / name).write_text(text, encoding="utf-8")
        out.append((folder / name, ["--row", "1"] if name.startswith("rows") else []))
    with gzip.open(folder / "rows.jsonl.gz", "wt", encoding="utf-8") as fh:
        fh.write(forms["rows.jsonl"])
    out.append((folder / "rows.jsonl.gz", ["--row", "1"]))
    pq.write_table(pa.Table.from_pylist([{"conversations": SHAREGPT}, {"conversations": SHAREGPT}]),
                   folder / "rows.parquet")
    out.append((folder / "rows.parquet", ["--row", "1"]))
    return out


def test_show_escapes_control_characters_of_the_chat_on_a_terminal_and_through_a_pipe(tmp_path, capsys):
    hostile = "clear\x1b[2J title\x1b]0;pwned\x07 cr\rend"
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": hostile}, {"role": "assistant", "content": "Red\x1b[31m."}]))
    assert main(["show", str(tokenizer_path("qwen2.5")), str(chat)]) == 0  # captured: not a terminal
    piped = capsys.readouterr().out
    shown = label_conversation(chat_tokenizer("qwen2.5"), json.loads(chat.read_text()))
    coloured = io.StringIO()
    print_shown(shown, out=coloured, colour=True)
    for out in (piped, coloured.getvalue()):
        assert "\x07" not in out and "\r" not in out and "\x1b[2J" not in out and "\x1b]0;" not in out
        assert "\x1b[31m" not in out
        text = re.sub(r"\x1b\[[0-9;]*m", "", out)  # the colours rich writes around each token
        assert r"clear\x1b[2J title\x1b]0;pwned\x07 cr\rend" in text and r"Red\x1b[31m." in text
    assert "<|im_start|>user\n" in piped  # the chat's own line breaks print as they are


def test_show_reads_every_chat_form_that_mask_reads(tmp_path, capsys):
    tok = str(tokenizer_path("qwen2.5"))
    bodies = {}
    for path, extra in _chat_forms(tmp_path):
        assert main(["show", tok, str(path), *extra]) == 0, (path, capsys.readouterr().err)
        out = capsys.readouterr().out
        bodies[path.name] = out.split("trained text is between [ and ]\n", 1)[1]
        if "sharegpt" in path.name or path.suffix == ".parquet":
            assert "note: sharegpt_messages_read" in out
    assert len(set(bodies.values())) == 1, bodies
    assert "<|im_start|>assistant\n[Paris.<|im_end|>]" in bodies["messages.json"]


def test_show_refuses_what_it_cannot_render_naming_the_file_and_row(tmp_path, capsys):
    tok = str(tokenizer_path("qwen2.5"))
    cases = {
        "other.json": ({"text": "Capital of France?"}, "has ['text']: a row is 'messages' (messages)"),
        "opens.json": ({"conversations": [{"from": "gpt", "value": "Welcome."}]},
                       "lossmask mask drops this row as no_exchange"),
        "speaker.json": ({"conversations": [{"from": "wizard", "value": "Hi"}]}, "'wizard', a speaker the role map"),
    }
    for name, (row, said) in cases.items():
        (tmp_path / name).write_text(json.dumps(row))
        assert main(["show", tok, str(tmp_path / name)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"lossmask show: error: {tmp_path / name}") and said in err and err.count("\n") == 1, err
    (tmp_path / "rows.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT}) + "\n")
    assert main(["show", tok, str(tmp_path / "rows.jsonl"), "--row", "3"]) == 1
    assert "rows.jsonl has 2 rows (counted from 0); it has no row 3" in capsys.readouterr().err
    assert main(["show", tok, str(tmp_path / "rows.jsonl"), "--row", "-1"]) == 1
    assert "rows.jsonl: row -1: rows are counted from 0" in capsys.readouterr().err
    assert main(["show", tok, str(tmp_path / "opens.json"), "--row", "1"]) == 1
    assert "opens.json holds one chat; it has no row 1" in capsys.readouterr().err
    assert main(["show", tok, str(tmp_path / "speaker.json"), "--role-map", "wizard=user"]) == 0  # read, trains nothing
    assert "0 of " in capsys.readouterr().out
    (tmp_path / "mixed.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"conversations": SHAREGPT}))
    assert main(["show", tok, str(tmp_path / "mixed.jsonl"), "--row", "1"]) == 1  # as mask: the messages column wins
    assert f"row 1 ({tmp_path / 'mixed.jsonl'}, line 2): column 'messages' is null" in capsys.readouterr().err


# -- lossmask show --html: whitespace stays visible ---------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"


def _page_with_markers(*texts: str) -> str:
    """A page whose response markers have ``texts`` (the chat: one trained token)."""
    from lossmask.show import Shown

    markers = Markers(response=[[k + 1] for k in range(len(texts))])
    shown = Shown("tok", "a  b", np.array([7]), ("a  b",), np.array([True]), Resolution(markers, "user", (), "test"),
                  {"response": [([k + 1], text) for k, text in enumerate(texts)]})
    return to_html(shown)


def test_html_keeps_and_marks_every_space_so_whitespace_variants_look_different():
    page = _page_with_markers("assistant\n \n", "assistant\n   \n", "x\ty")
    cells = re.findall(r'<code class="mk">(.*?)</code>', page.split("Markers:", 1)[1])
    assert cells[:2] == ["&#x27;assistant\\n" + '<span class="ws s"> </span>' * n + "\\n&#x27;" for n in (1, 3)]
    assert cells[2] == "&#x27;x\\ty&#x27;"  # repr writes the tab as \t
    assert "code.mk, .t { white-space: pre; }" in page and '.ws.s::before { content: "\\00b7"; }' in page
    chat = page.split('<div class="chat">', 1)[1]
    assert '>a<span class="ws s"> </span><span class="ws s"> </span>b</span>' in chat  # two spaces inside a token


def _screenshot(page: str, folder, name: str, width: int = 900, height: int = 420) -> bytes:
    import subprocess

    html_path, png_path = folder / f"{name}.html", folder / f"{name}.png"
    html_path.write_text(page, encoding="utf-8")
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png_path}", html_path.as_uri()],
                   check=True, capture_output=True, timeout=120)
    return png_path.read_bytes()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="headless Chromium (/usr/bin/chromium) is not installed")
def test_a_browser_draws_markers_that_differ_only_in_spaces_apart(tmp_path):
    """Rendered by headless Chromium, two pages whose markers differ only in a run of spaces are two different
    pictures, and a page drawn twice is the same picture (the difference is the whitespace, nothing else)."""
    one = _screenshot(_page_with_markers("assistant\n \n"), tmp_path, "one-space")
    again = _screenshot(_page_with_markers("assistant\n \n"), tmp_path, "one-space-again")
    three = _screenshot(_page_with_markers("assistant\n   \n"), tmp_path, "three-spaces")
    assert hashlib.sha256(one).hexdigest() == hashlib.sha256(again).hexdigest()
    assert hashlib.sha256(one).hexdigest() != hashlib.sha256(three).hexdigest()


def test_show_applies_the_shape_options_of_mask(tmp_path, capsys):
    tok = str(tokenizer_path("qwen2.5"))
    chat = tmp_path / "opens.json"
    chat.write_text(json.dumps({"conversations": [{"from": "gpt", "value": "Welcome back."}, *SHAREGPT]}))
    assert main(["show", tok, str(chat)]) == 0
    out = capsys.readouterr().out
    assert "note: leading_assistant_dropped:" in out and "Welcome back." not in out
    assert main(["show", tok, str(chat), "--leading-assistant", "keep"]) == 0
    out = capsys.readouterr().out
    assert "leading_assistant_dropped" not in out and "[Welcome back.<|im_end|>]" in out


def test_show_labels_token_ids_and_text_pairs_as_the_job_does(tmp_path, capsys):
    from lossmask.chat.tokenizer import load_tokenizer

    tok = str(tokenizer_path("qwen2.5"))
    ct = load_tokenizer(tok)
    ids = ct.encode_with_offsets(ct.render(CHAT))[0].tolist()
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": ids}) + "\n")
    assert main(["show", tok, str(tmp_path / "ids.jsonl"), "--row", "1"]) == 0
    out = capsys.readouterr().out
    assert "note: a row of token ids, labelled by lossmask mask itself" in out
    assert out.endswith("<|im_start|>assistant\n[Paris.<|im_end|>]\n\n")
    (tmp_path / "text.json").write_text(json.dumps({"prompt": "Capital of France?", "completion": " Paris."}))
    assert main(["show", tok, str(tmp_path / "text.json"), "--html", str(tmp_path / "text.html")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["show", tok, str(tmp_path / "text.json")]) == 0
    out = capsys.readouterr().out
    assert "prompt and completion text (no chat template)" in out
    assert "\nCapital of France?[ Paris." in out and "]" == out.rstrip()[-1]  # the completion and its EOS train


# one story with mask: a row the job drops shows its reason and nothing trained; a row it keeps, the job's labels
TOOL_ROW = {"messages": [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "minus three, snowing"},
    {"role": "assistant", "content": "It is -3 and snowing."}]}
# a trailing space Llama-3 trims, whose trimmed text recurs later (as in real chats): kept by mask, so by show
TRIMMED_ROW = {"messages": [
    {"role": "user", "content": "How old is the youngest?"}, {"role": "assistant", "content": "7 "},
    {"role": "user", "content": "Brother or sister?"}, {"role": "assistant", "content": "Sister."},
    {"role": "user", "content": "7 year old boys are the worst"}, {"role": "assistant", "content": "They are."}]}


@pytest.mark.parametrize("family, row, dropped", [("phi-3", TOOL_ROW, "content_dropped"),
                                                  ("llama-3.1", TRIMMED_ROW, None)])
def test_show_tells_the_story_mask_tells_for_the_same_row(tmp_path, capsys, family, row, dropped):
    import pyarrow.parquet as pq

    from lossmask import mask_files

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row) + "\n")
    report = mask_files(path, tmp_path / "out.parquet", tokenizer=chat_tokenizer(family), max_drop_fraction=1.0)
    assert main(["show", str(tokenizer_path(family)), str(path)]) == 0
    out = capsys.readouterr().out
    if dropped is not None:
        assert report.dropped[dropped] == 1 and report.rows_out == 0
        assert f"note: lossmask mask drops this row, so nothing of it trains: {dropped}: message 1 (assistant)" in out
        assert "\n0 of " in out and "[" not in out.split("trained text is between [ and ]", 1)[1]
        return
    assert report.rows_out == 1, report.summary()
    table = pq.read_table(tmp_path / "out.parquet")
    ct = chat_tokenizer(family)
    ids, labels = table.column("input_ids")[0].as_py(), table.column("labels")[0].as_py()
    trained = "".join(f"[{ct.decode([t])}]" if label != -100 else ct.decode([t]) for t, label in zip(ids, labels))
    assert out.rstrip("\n").endswith(trained.replace("][", "").rstrip("\n"))
    assert "[7<|eot_id|>]" in out and "[Sister.<|eot_id|>]" in out and "[They are.<|eot_id|>]" in out
