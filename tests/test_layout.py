"""The house: one folder per stage, imports one way, no circles, and a public surface that stays put.

The graph is read from the source with ``ast`` by ``tools/import_graph.py`` (every import, lazy ones
too; ``if TYPE_CHECKING:`` blocks aside). Run that script to see the floors.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import pytest

from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
import_graph = load_script(ROOT / "tools" / "import_graph.py")

# The faces: what users import and run. They may import any stage below and each other (without circles).
FACES = {"lossmask", "__main__", "cli", "collator", "example", "hf", "lora", "mlx", "ray", "show", "vision"}
# Each stage may import the stages listed for it, and itself; nothing else of lossmask.
MAY_IMPORT = {
    "options": set(),  # the one options object every stage reads: it imports nothing of lossmask
    "engine": {"options"},
    "chat": {"engine", "options"},
    "markers": {"chat", "engine", "options"},
    "jobs": {"markers", "chat", "engine", "options"},
}
KERNELS = "lossmask.engine.kernels"

EDGES = import_graph.graph()


def _stage(module: str) -> str:
    return import_graph.stage_of(module)


def test_every_module_belongs_to_a_stage_or_is_a_face():
    strays = sorted(m for m in EDGES if _stage(m) not in MAY_IMPORT and _stage(m) not in FACES)
    assert not strays, f"{strays} sit at the top of src/lossmask: move each into its stage's folder (or declare a new face here)"


def test_no_import_circles():
    assert import_graph.circles(EDGES) == []


@pytest.mark.parametrize("stage", sorted(MAY_IMPORT))
def test_stage_imports_run_one_way(stage):
    against = sorted(
        f"{m} imports {t}"
        for m, targets in EDGES.items() if _stage(m) == stage
        for t in targets if _stage(t) != stage and _stage(t) not in MAY_IMPORT[stage]
    )
    assert not against, f"{stage} may import only {sorted(MAY_IMPORT[stage]) or 'nothing of lossmask'}: " + "; ".join(against)


def test_only_the_engine_calls_the_kernels():
    callers = sorted(m for m, targets in EDGES.items() if not m.startswith("lossmask.engine")
                     and any(t == KERNELS or t.startswith(KERNELS + ".") for t in targets))
    assert not callers, f"{callers} import the kernels: ask lossmask.engine.get_backend instead"


def test_the_graph_sees_lazy_imports_and_skips_type_checking():
    import ast

    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..jobs import x\ndef f():\n    from ..chat import y\n"
    found = import_graph._imports(ast.parse(code), "lossmask.engine.labels", False)
    assert "lossmask.chat.y" in found
    assert not any(name.startswith("lossmask.jobs") for name in found)


def test_a_circle_is_found():
    assert import_graph.circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# -- the public surface --------------------------------------------------------------------------------

SURFACE = json.loads((ROOT / "tests" / "data" / "public_surface.json").read_text(encoding="utf-8"))


def _public(module: str) -> list[str]:
    m = importlib.import_module(module)
    names = getattr(m, "__all__", None)
    if names is None:
        names = [n for n, v in vars(m).items() if not n.startswith("_") and getattr(v, "__module__", None) == m.__name__]
    return sorted(names)


def test_lossmask_all_is_pinned():
    import lossmask

    assert sorted(lossmask.__all__) == SURFACE["lossmask"]
    assert all(hasattr(lossmask, name) for name in lossmask.__all__)


@pytest.mark.parametrize("module", ["lossmask.hf", "lossmask.ray", "lossmask.collator", "lossmask.mlx"])
def test_integration_names_are_pinned(module):
    pytest.importorskip({"lossmask.collator": "torch", "lossmask.mlx": "mlx.core"}.get(module, "pyarrow"))
    assert _public(module) == SURFACE[module]


def test_cli_commands_and_flags_are_pinned():
    from lossmask import cli

    found: dict[str, dict] = {}

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        found[name] = {
            "options": sorted(s for a in parser._actions for s in a.option_strings),
            "positionals": [a.dest for a in parser._actions
                            if not a.option_strings and not isinstance(a, argparse._SubParsersAction)],
        }
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, sub in action.choices.items():
                    walk(sub, f"{name} {command}")

    walk(cli.build_parser(), "lossmask")
    assert found == SURFACE["cli"]


def _import_kernels_from_the_checkout(tmp_path, *flags: str, pythonpath: Path | None = None):
    """``import kernels`` with the checkout's root first on ``sys.path``, as ``python -m pytest`` run there puts it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    code = "import kernels; print(kernels.__file__)"
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_kernels_folder_never_shadows_the_kernels_package(tmp_path):
    # transformers imports Hugging Face's ``kernels`` package whenever it is installed (5.25 installs it).
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("CUDAProperties = object\n")
    run = _import_kernels_from_the_checkout(tmp_path, pythonpath=tmp_path / "site")
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()) == other / "__init__.py"


def test_without_a_kernels_package_the_import_fails_as_a_missing_module(tmp_path):
    run = _import_kernels_from_the_checkout(tmp_path, "-S")  # -S: no site-packages, so no kernels package anywhere
    assert run.returncode == 1
    assert "ModuleNotFoundError: No module named 'kernels'" in run.stderr and "lossmask.engine.kernels" in run.stderr
