"""The documentation as a reader follows it: links into a page's sections land on a heading, and the API reference
builds from the docstrings, offline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if in_code or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_into_sections_land_on_a_heading(page):
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+://", target):
            continue
        linked = (page.parent / target).resolve() if target else page
        if linked.suffix != ".md":
            continue
        assert anchor in anchors(linked), f"{page.name} links to {target or page.name}#{anchor}, which no heading makes"


# The reference is built in a fresh interpreter where torch and mlx cannot be imported, as on an install without
# those extras: the faces that need them are left out with a line each, and everything else is documented.
WITHOUT_TORCH_AND_MLX = r"""
import runpy, sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "mlx", "mlx_lm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
sys.argv = ["api_reference.py", "--out", sys.argv[1]]
runpy.run_path("tools/api_reference.py", run_name="__main__")
"""


def test_the_api_reference_builds_offline_and_leaves_out_faces_whose_extra_is_missing(tmp_path):
    pytest.importorskip("pdoc")
    out = tmp_path / "api"
    run = subprocess.run([sys.executable, "-c", WITHOUT_TORCH_AND_MLX, str(out)], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert (out / "index.html").is_file()
    package = (out / "lossmask.html").read_text(encoding="utf-8")
    for name in ("mask_files", "MaskOptions", "make_labels", "load_tokenizer", "detect_markers"):
        assert f'id="{name}"' in package, name
    assert 'id="MaskOptions"' in (out / "lossmask" / "options.html").read_text(encoding="utf-8")
    hf = (out / "lossmask" / "hf.html").read_text(encoding="utf-8")
    assert 'id="mask_dataset"' in hf and 'id="train_on_responses_only"' in hf
    assert (out / "lossmask" / "ray.html").is_file()
    for face, extra in (("collator", "torch"), ("vision", "torch"), ("mlx", "mlx")):
        assert not (out / "lossmask" / f"{face}.html").exists()
        assert f"lossmask.{face}: left out, it needs" in run.stderr and f"lossmask[{extra}]" in run.stderr
