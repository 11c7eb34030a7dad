"""The docs as a manual: every relative link in README.md, docs/ and benchmarks/ resolves (the
file exists and, for `file.md#anchor` in README.md and docs/, the heading does: GitHub's anchors,
lower case, punctuation dropped, spaces to hyphens, -1/-2 for repeats), no page of docs/ grows
past 20 KB, nor the hand-written pages past 150 KB in all. A dated record under benchmarks/ is
never edited, so only its files are checked: the sections of a living doc it points at may move."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[tuple[int, str]]:
    found = []
    in_code = False
    for i, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                found.append((i, target))
    return found


def test_the_pages_exist():
    assert len(PAGES) > 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    bad = []
    for line, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(REPO)}:{line}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and "benchmarks" not in page.relative_to(REPO).parts and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(REPO)}:{line}: {target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", sorted((REPO / "docs").rglob("*.md")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_doc_page_stays_under_20_kb(page):
    """A guide that grows past this is turning back into a lab notebook: measured history goes to
    a dated record under benchmarks/, and the page keeps the current figures."""
    assert page.stat().st_size <= 20 * 1024, f"{page.relative_to(REPO)}: {page.stat().st_size:,} bytes"


def test_the_hand_written_docs_stay_under_150_kb_in_all():
    """The generated reference (docs/reference/) is as long as the config and the CLI are; the
    rest is read as a manual, and a manual that keeps growing is read by nobody."""
    pages = [p for p in (REPO / "docs").rglob("*.md") if "reference" not in p.relative_to(REPO / "docs").parts]
    total = sum(p.stat().st_size for p in pages)
    biggest = sorted(pages, key=lambda p: -p.stat().st_size)[:3]
    assert total < 150_000, f"docs/ without docs/reference/: {total:,} bytes; the largest: " + ", ".join(
        f"{p.relative_to(REPO)} {p.stat().st_size:,}" for p in biggest
    )
