"""Every relative link in README.md and docs/*.md leads somewhere: the file exists, and an
``#anchor`` is one of the target page's headings as GitHub slugs them."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without its fenced code blocks and inline code, where links are text."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (link targets and backticks dropped),
    lower case, punctuation other than hyphens and underscores removed, spaces as
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """A page's heading anchors; a repeated one gets -1, -2, ... as on GitHub."""
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    seen: Counter[str] = Counter()
    found = set()
    for heading in re.findall(r"(?m)^#{1,6} +(.+?) *#* *$", text):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    return found


def test_slugs_are_githubs() -> None:
    assert slug("Stop, resume, failures") == "stop-resume-failures"
    assert slug("The cost model (`async_rl/sim/costs.py`)") == "the-cost-model-async_rlsimcostspy"
    assert slug("Time-shared devices (`run.colocate = \"time\"`)") == (
        "time-shared-devices-runcolocate--time")
    assert slug("The collective's cost: 1, 2 and 4 engines") == (
        "the-collectives-cost-1-2-and-4-engines")


def _links(page: Path) -> list[str]:
    return [target or image for target, image in LINK.findall(_prose(page.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    links = _links(page)
    assert page.name == "README.md" or page.parent.name == "docs"
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:, ...
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_pages_have_links() -> None:
    counts = {page.name: len(_links(page)) for page in PAGES}
    assert len(counts) >= 10
    assert counts["README.md"] >= 20, counts
