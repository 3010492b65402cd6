"""The README stays a short door into docs/, its links lead somewhere, and the page on
resuming your training is one click from the docs' top navigation.

The docs themselves are checked by ``mkdocs build --strict`` in scripts/test (links
between pages, anchors, the nav): these tests read files only, so they stay fast."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

README = REPO / "README.md"
RESUMING = "resuming.md"
# A Markdown link's target: ](path) or ](path#anchor), up to the first space or ')'.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs' toc both make it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, fenced code left out."""
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            found.add(slug(m.group(1)))
    return found


def top_level_nav(mkdocs_yml: str) -> list[tuple[str, str]]:
    """``mkdocs.yml``'s top-level nav entries as (title, target): the lines ``  - Title: x``
    right under ``nav:`` (a section's own entries are indented further)."""
    entries, in_nav = [], False
    for line in mkdocs_yml.splitlines():
        if line.startswith("nav:"):
            in_nav = True
        elif in_nav and line and not line.startswith(" "):
            break
        elif in_nav and (m := re.fullmatch(r"  - ([^:]+):\s*(\S*)\s*", line)):
            entries.append((m.group(1), m.group(2)))
    return entries


def test_the_readme_is_a_short_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines; the rest belongs in docs/"


def test_every_relative_link_in_the_readme_leads_to_a_file_and_its_heading() -> None:
    links = relative_links(README.read_text())
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path if path else README
        assert target.exists(), f"README.md links to {link}, which does not exist"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), (
                f"README.md links to {link}: {path or 'README.md'} has no such heading"
            )


def test_resuming_your_training_is_a_top_level_nav_entry() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    assert re.search(r"^strict: true$", config, re.M) and re.search(r"^docs_dir: docs$", config, re.M)
    nav = top_level_nav(config)
    assert (REPO / "docs" / RESUMING).is_file()
    assert RESUMING in [target for _, target in nav], nav
    for _, target in nav:
        assert (REPO / "docs" / target).is_file(), target
