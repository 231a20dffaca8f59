"""The API reference, built from the docstrings with pdoc (the ``docs`` extra), offline, as HTML.

    python tools/api_reference.py                # into build/api; open build/api/index.html
    python tools/api_reference.py --out DIR

It documents the package's public names (``lossmask`` and its ``__all__``: ``mask_files``, ``MaskOptions``, ...)
and the faces people train with: ``options``, ``hf``, ``collator``, ``vision``, ``mlx`` and ``ray``. A face whose
optional dependency is not installed (torch for ``collator`` and ``vision``, mlx for ``mlx``) cannot be imported,
so it is left out, with one line naming the extra that brings it; the rest is built.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# module -> the extra that brings what it imports at the top
MODULES = {
    "lossmask": "",
    "lossmask.options": "",
    "lossmask.hf": "hf",
    "lossmask.collator": "torch",
    "lossmask.vision": "torch",
    "lossmask.mlx": "mlx",
    "lossmask.ray": "ray",
}


def importable(modules: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(modules that import, one line for each that does not)``."""
    kept, left_out = [], []
    for name, extra in modules.items():
        try:
            importlib.import_module(name)
        except ImportError as exc:
            left_out.append(f"{name}: left out, it needs {exc.name or 'a missing module'} "
                            f"(pip install 'lossmask[{extra or 'all'}]')")
        else:
            kept.append(name)
    return kept, left_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build lossmask's API reference from its docstrings (pdoc).")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "api", help="output folder (default build/api)")
    args = parser.parse_args(argv)
    try:
        import pdoc
    except ImportError:
        print("api reference: pdoc is not installed: pip install -e '.[docs]'", file=sys.stderr)
        return 1
    kept, left_out = importable(MODULES)
    for line in left_out:
        print(f"api reference: {line}", file=sys.stderr)
    pdoc.render.configure(docformat="restructuredtext", footer_text="lossmask", show_source=False)
    pdoc.pdoc(*kept, output_directory=args.out)
    print(f"api reference: {len(kept)} modules in {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
