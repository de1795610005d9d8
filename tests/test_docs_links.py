"""Every relative link in README.md and docs/*.md resolves: the file exists inside the repository,
and a ``#anchor`` names a heading of the page it points to (GitHub's slugs).  The README is a
landing page whose material lives in docs/ (issue 47), so a link left pointing at a moved
section, or out of the checkout (``../shared``), must fail here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: ``[text](target)``; a target with a space or a title is not used in these pages.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without its fenced blocks (a ``# comment`` there is no heading, a ``[x](y)`` no link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def links(page: Path) -> list[str]:
    # Inline code is no link either: `df.write.format(...)` would otherwise read as one.
    prose = re.sub(r"`[^`\n]*`", "", _prose(page.read_text()))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


def broken(page: Path) -> list[str]:
    """The relative links of ``page`` that do not resolve, each with the reason."""
    out = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO):
            out.append(f"{target}: outside the repository")
        elif not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target}: {dest.relative_to(REPO)} has no heading #{anchor}")
    return out


def test_the_pages_link_to_each_other():
    """The README links every docs page, and the check below has links to check."""
    readme = {(REPO / t.partition("#")[0]).resolve() for t in links(REPO / "README.md")}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in readme]
    assert unlinked == [], f"README.md's Documentation table does not link docs/{unlinked}"
    assert sum(len(links(p)) for p in PAGES) >= 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []
    assert "../shared" not in page.read_text(), f"{page.name} refers outside the repository"


def test_a_heading_anchor_is_githubs_slug():
    assert slug("writer: Spark's own writer or the sink's") == "writer-sparks-own-writer-or-the-sinks"
    assert slug('By name: `format("twophase-kafka")`, `-jdbc`, `-files`') == "by-name-formattwophase-kafka--jdbc--files"
    assert slug("1. Kafka → windowed word count → PostgreSQL") == "1-kafka--windowed-word-count--postgresql"
