"""The on-disk marker cache: a hit gives the same resolution (warnings included) without resolving again."""

from __future__ import annotations

import warnings

import pytest

from conftest import chat_tokenizer
from lossmask.markers.cache import cache_dir, resolve_cached
from lossmask.jobs.stream import plan_workers


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOSSMASK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOSSMASK_CACHE", raising=False)
    return tmp_path / "markers"


def _counting(ct, **arguments):
    from lossmask.markers.policy import resolve_markers

    calls = []

    def resolve():
        calls.append(1)
        return resolve_markers(ct, **arguments)

    return resolve, calls


def test_hit_returns_the_same_markers_without_resolving(cache):
    ct = chat_tokenizer("qwen2.5")
    resolve, calls = _counting(ct)
    first = resolve_cached(ct, resolve, model_name=None, strict=False)
    assert len(calls) == 1 and len(list(cache.iterdir())) == 1
    second = resolve_cached(ct, resolve, model_name=None, strict=False)
    assert len(calls) == 1
    assert second.markers == first.markers and second.source == first.source
    assert second.messages == first.messages and second.reason == first.reason
    resolve_cached(ct, resolve, model_name="Qwen/Qwen2.5-7B-Instruct", strict=False)  # other arguments: a miss
    assert len(calls) == 2


def test_template_kwargs_are_part_of_the_key(cache):
    from lossmask import load_tokenizer

    ct = chat_tokenizer("qwen3")
    thinking_off = load_tokenizer(ct, template_kwargs={"enable_thinking": False})
    resolve, calls = _counting(ct)
    resolve_cached(ct, resolve)
    resolve_off, calls_off = _counting(thinking_off)
    resolve_cached(thinking_off, resolve_off)
    assert len(calls) == len(calls_off) == 1 and len(list(cache.iterdir())) == 2


def test_warnings_are_emitted_again_on_a_hit(cache):
    ct = chat_tokenizer("falcon")  # no stop token: detection warns
    resolve, calls = _counting(ct)
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        resolve_cached(ct, resolve)
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        resolve_cached(ct, resolve)
    assert len(calls) == 1 and first
    assert [(w.category, str(w.message)) for w in first] == [(w.category, str(w.message)) for w in second]


def test_switched_off_and_corrupt_entries(cache, monkeypatch):
    ct = chat_tokenizer("qwen2.5")
    resolve, calls = _counting(ct)
    resolve_cached(ct, resolve)
    for entry in cache.iterdir():
        entry.write_text("{not json")
    resolve_cached(ct, resolve)  # unreadable: resolved again, and rewritten
    assert len(calls) == 2
    resolve_cached(ct, resolve)
    assert len(calls) == 2
    monkeypatch.setenv("LOSSMASK_CACHE", "0")
    assert cache_dir() is None
    resolve_cached(ct, resolve)
    assert len(calls) == 3


def test_plan_workers_from_the_work_size():
    assert plan_workers(1, 20_000, 16_384, renders=True, cores=8) == (1, 2_500)  # eight batches: render and tokenise overlap
    assert plan_workers(1, 1_000_000, 16_384, renders=True, cores=8) == (1, 16_384)
    assert plan_workers(2, 20_000, 16_384, renders=False, cores=8) == (1, 16_384)  # token ids: nothing to render
    assert plan_workers(2, 1_000, 16_384, renders=True, cores=8) == (1, 512)  # too small to pay for a process
    assert plan_workers(2, 20_000, 16_384, renders=True, cores=8) == (2, 2_500)  # four batches per worker
    assert plan_workers(8, 5_000, 16_384, renders=True, cores=8) == (2, 625)
    assert plan_workers(2, None, 16, renders=True, cores=8) == (2, 16)
    assert plan_workers(1, None, 16_384, renders=True, cores=2) == (1, 2_048)  # rows unknown: rendering overlaps
    assert plan_workers(8, 100_000, 16_384, renders=True, cores=4) == (4, 6_250)  # at most one worker per core
    assert plan_workers(2, 20_000, 16_384, renders=True, cores=2) == (2, 2_500)  # the parent only joins their parts


def test_a_hit_names_the_folder_of_the_current_job(cache, tmp_path):
    import shutil

    from conftest import tokenizer_path
    from lossmask import load_tokenizer

    for copy in ("a", "b"):
        shutil.copytree(tokenizer_path("qwen2.5"), tmp_path / copy)
    first, second = (load_tokenizer(str(tmp_path / copy)) for copy in ("a", "b"))
    resolve_cached(first, _counting(first)[0], model_name=None, strict=False)
    resolve, calls = _counting(second)
    hit = resolve_cached(second, resolve, model_name=None, strict=False)
    assert not calls, "the same tokenizer files in another folder share the cached resolution"
    text = "\n".join(hit.messages)
    assert str(tmp_path / "b") in text and str(tmp_path / "a") not in text


def test_the_key_reads_every_code_file_it_names():
    # a file that moved would be hashed as "missing": an edit to it would no longer change the key
    from pathlib import Path

    from lossmask.markers import cache

    package = Path(cache.__file__).resolve().parent.parent
    assert [name for name in cache.CODE_FILES if not (package / name).is_file()] == []


# -- what resolution reads off the tokenizer object is part of the key ----------------------------------------

QWEN_PRESET = {"_unsloth_input_part": "<|im_start|>user\n", "_unsloth_output_part": "<|im_start|>assistant\n"}


def _hf(family="qwen2.5", **attributes):
    """A fresh Hugging Face tokenizer of ``family`` (never the session's shared one), with ``attributes`` set on it."""
    transformers = pytest.importorskip("transformers")
    from conftest import tokenizer_path

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_path(family)), local_files_only=True)
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    return tokenizer


def _reads(hf, ct, resolve) -> dict[str, set[str]]:
    """The attributes ``resolve()`` reads off the Hugging Face tokenizer and off the ``ChatTokenizer``, by name."""
    from lossmask.chat.tokenizer import ChatTokenizer

    seen: dict[str, set[str]] = {"tokenizer": set(), "chat": set()}
    watched = ((type(hf), hf, "tokenizer"), (ChatTokenizer, ct, "chat"))
    originals = [(cls, cls.__getattribute__) for cls, _, _ in watched]

    def recorder(original, obj, where):
        def get(self, name):
            if self is obj:
                seen[where].add(name)
            return original(self, name)
        return get

    try:
        for (cls, original), (_, obj, where) in zip(originals, watched):
            cls.__getattribute__ = recorder(original, obj, where)
        resolve()
    finally:
        for cls, original in originals:
            cls.__getattribute__ = original
    return seen


# Each attribute a resolution reads, and a change to it that must change the key (a fresh tokenizer each time).
# Methods are not listed: what they do follows from the state below, the serialised vocabulary and the template.
def _change_special(name):
    return lambda hf: setattr(hf, name, "<|fim_pad|>")


EOS, BOS, PAD, UNK = (_change_special(f"{name}_token") for name in ("eos", "bos", "pad", "unk"))
ADDED = lambda hf: hf.add_tokens(["<zz_new>"])  # noqa: E731


TOKENIZER_CHANGES = {
    # read only beside an output part (alone it is ignored, by the policy and the key alike)
    "_unsloth_input_part": lambda hf: setattr(hf, "_unsloth_input_part", "<|im_start|>user\n"),
    "_unsloth_output_part": lambda hf: setattr(hf, "_unsloth_output_part", "<|im_start|>assistant\n"),
    "eos_token": EOS,
    "eos_token_id": EOS,
    "bos_token_id": BOS,
    "pad_token_id": PAD,
    "unk_token_id": UNK,
    "special_tokens_map": EOS,
    "_special_tokens_map": EOS,
    "all_special_ids": UNK,
    "all_special_tokens": UNK,
    "_extra_special_tokens": lambda hf: hf.add_special_tokens({"additional_special_tokens": ["<|fim_pad|>"]}),
    "clean_up_tokenization_spaces": lambda hf: setattr(hf, "clean_up_tokenization_spaces",
                                                       not hf.clean_up_tokenization_spaces),
    "split_special_tokens": lambda hf: setattr(hf, "split_special_tokens", not hf.split_special_tokens),
    "chat_template": lambda hf: setattr(hf, "chat_template", hf.chat_template.replace("You are Qwen", "You are Q")),
    # the serialised vocabulary (tokenizer.json, added tokens included)
    "_tokenizer": ADDED,
    "backend_tokenizer": ADDED,
    "added_tokens_decoder": ADDED,
}
# read, and unable to change a resolution: a class constant, the logging switch, the length a warning is given at,
# the names of an encoding's outputs, a flag only seq2seq target encoding sets and the hook it probes for
TOKENIZER_INERT = {"SPECIAL_TOKENS_ATTRIBUTES", "verbose", "model_max_length", "model_input_names",
                   "_in_target_context_manager", "_switch_to_input_mode"}
CHAT_CHANGES = {  # (keyword of load_tokenizer or an attribute set on the adapter, value)
    "name": ("name", "meta-llama/Llama-3.1-8B-Instruct"),  # another table family, tried when detection fails
    "template_kwargs": ("template_kwargs", {"add_vision_id": True}),
    "templates": ("chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    "template_name": ("template_name", None),  # a string template has no names: changed through ``templates``
    "_unsloth_input_part": ("_unsloth_input_part", "<|im_start|>user\n"),
    "_unsloth_output_part": ("_unsloth_output_part", "<|im_start|>assistant\n"),
}
# derived, once per adapter, from what the key holds: the vocabulary, the special tokens, the template
CHAT_DERIVED = {"tokenizer", "_tokenizer", "added_ids", "special_ids", "content_tokens", "text_encoder",
                "renders_parts_only", "processor"}


def _key(ct):
    from lossmask.markers.cache import cache_key

    return cache_key(ct, {"model_name": None, "strict": False})


@pytest.mark.parametrize("preset", [False, True], ids=["detected", "unsloth-preset"])
def test_the_key_covers_every_attribute_resolution_reads_off_the_tokenizer(monkeypatch, preset):
    from lossmask import load_tokenizer
    from lossmask.chat.tokenizer import ChatTokenizer
    from lossmask.markers.policy import resolve_markers

    monkeypatch.setenv("LOSSMASK_CACHE", "0")
    hf = _hf(**(QWEN_PRESET if preset else {}))
    ct = load_tokenizer(hf)
    seen = _reads(hf, ct, lambda: resolve_markers(ct))
    data = {n for n in seen["tokenizer"] if not n.startswith("__") and not callable(getattr(hf, n, None))}
    unknown = data - TOKENIZER_CHANGES.keys() - TOKENIZER_INERT
    assert not unknown, f"resolution reads {sorted(unknown)} off the tokenizer: key it (markers/cache.py object_facts) " \
                        "and give it a change here"
    chat = {n for n in seen["chat"] if not n.startswith("__") and not callable(getattr(type(ct), n, None))}
    unknown = chat - CHAT_CHANGES.keys() - CHAT_DERIVED
    assert not unknown, f"resolution reads {sorted(unknown)} off the ChatTokenizer: key it and give it a change here"
    assert {"_unsloth_input_part", "_unsloth_output_part", "special_tokens_map"} <= seen["tokenizer"]
    output_only = {"_unsloth_output_part": QWEN_PRESET["_unsloth_output_part"]}
    base = {False: _key(ChatTokenizer(_hf())), True: _key(ChatTokenizer(_hf(**output_only)))}
    changes: dict = {}  # one run per distinct change (several attributes follow from one)
    for name in sorted(data & TOKENIZER_CHANGES.keys()):
        changes.setdefault(TOKENIZER_CHANGES[name], []).append(name)
    for change, names in changes.items():
        after = "_unsloth_input_part" in names  # an input part is read only beside an output part
        changed = _hf(**(output_only if after else {}))
        change(changed)
        assert _key(ChatTokenizer(changed)) != base[after], f"a change to the tokenizer's {names} leaves the key as it was"
    for name in sorted(chat & CHAT_CHANGES.keys()):
        keyword, value = CHAT_CHANGES[name]
        if keyword == "template_name":
            continue
        after = name == "_unsloth_input_part"
        if keyword in ("name", "template_kwargs", "chat_template"):
            changed = ChatTokenizer(_hf(), **{keyword: value})
        else:
            changed = ChatTokenizer(_hf())
            if after:
                changed._unsloth_output_part = QWEN_PRESET["_unsloth_output_part"]
            setattr(changed, keyword, value)
        assert _key(changed) != base[after], f"a change to the adapter's {name} leaves the key as it was"


def _drop_in(hf, rows):
    """The labels ``hf.train_on_responses_only`` gives ``rows`` (token ids) for a bare call, as Unsloth Studio makes it."""
    from types import SimpleNamespace

    from lossmask.hf import train_on_responses_only

    pytest.importorskip("datasets")
    import datasets

    trainer = SimpleNamespace(processing_class=hf, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                              eval_dataset=None, data_collator=None, args=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rows as token ids only: the drop-in's note about message text
        train_on_responses_only(trainer, verbose=False, max_drop_fraction=1.0)
    return list(trainer.train_dataset["labels"])


PRESET_CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
]


def _ids(hf, chats):
    out = []
    for chat in chats:
        ids = hf.apply_chat_template(chat, tokenize=True)
        out.append([int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)])
    return out


def test_unsloth_preset_and_its_absence_resolve_alike_fresh_warm_in_either_order_and_uncached(cache, monkeypatch):
    """A warm cache holding the same tokenizer files never stands in for the preset set on the object, nor the reverse;
    the drop-in labels what the resolution says in every state."""
    from lossmask import load_tokenizer
    from lossmask.jobs.stream import resolve_job_markers

    def resolution(preset):
        hf = _hf(**(QWEN_PRESET if preset else {}))
        markers, source, _ = resolve_job_markers(None, tokenizer=load_tokenizer(hf), model_name=None, strict=False)
        return markers, source, _drop_in(hf, rows)

    rows = _ids(_hf(), PRESET_CHATS)
    monkeypatch.setenv("LOSSMASK_CACHE", "0")
    uncached = {preset: resolution(preset) for preset in (True, False)}
    assert uncached[True][1] == "user" and uncached[False][1] == "detected"
    assert uncached[True][0] != uncached[False][0]  # the preset's markers are not detection's: the check below is sharp
    monkeypatch.delenv("LOSSMASK_CACHE")
    for order in ((True, False), (False, True)):
        monkeypatch.setenv("LOSSMASK_CACHE_DIR", str(cache.parent / f"order-{order[0]}"))
        for preset in order + order:  # fresh, then warm
            assert resolution(preset) == uncached[preset], (order, preset)


# parts without their newline: the newline after the header then trains, so the preset's labels are not detection's
BARE_PRESET = {"_unsloth_input_part": "<|im_start|>user", "_unsloth_output_part": "<|im_start|>assistant"}


@pytest.mark.parametrize("preset", [QWEN_PRESET, BARE_PRESET], ids=["with-newline", "without-newline"])
def test_the_drop_in_trains_what_unsloth_zoo_trains_with_the_preset_whatever_the_cache_held(cache, monkeypatch, preset):
    monkeypatch.setenv("UNSLOTH_ZOO_DISABLE_GPU_INIT", "1")
    try:
        from unsloth_zoo.dataset_utils import train_on_responses_only as unsloth
    except Exception as exc:  # noqa: BLE001 - not installed, or it needs a GPU stack this machine lacks
        pytest.skip(f"unsloth_zoo does not import here ({type(exc).__name__}); pip install unsloth_zoo --no-deps")
    rows = _ids(_hf(), PRESET_CHATS)
    expected = unsloth(None, tokenizer=_hf(**preset), return_function=True)({"input_ids": rows})["labels"]
    expected = [list(labels) for labels in expected]
    for before in (None, {}, preset):  # an empty cache; one warmed without the preset; one warmed with it
        if before is not None:
            warmed = _drop_in(_hf(**before), rows)
            assert (warmed == expected) == (before == preset or preset is QWEN_PRESET), before
        assert _drop_in(_hf(**preset), rows) == expected, before
