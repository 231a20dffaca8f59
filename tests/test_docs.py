"""The documentation as a reader follows it: links into a page's sections land on a heading, and the API reference
builds from the docstrings, offline."""

from __future__ import annotations

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
