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
