"""The README stays a newcomer's page and the docs hold the rest: the README's length, and links that lead
somewhere. That every generated block matches results/ is the renderer's test (lab/tests/test_render.py)."""
import re

import pytest

from conftest import ROOT

pytestmark = pytest.mark.unit

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "results" / "README.md",
         ROOT / "lab" / "README.md"]
README_MAX_LINES = 250  # issue 32: what it is, the quick start, one table, the commands, the links


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert missing == []
