"""Every relative link of the README, the manual (docs/), the bench index and the lab's indexes
resolves to a file or folder of the repository."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "bench" / "README.md", REPO / "lab" / "README.md",
                REPO / "lab" / "probes" / "README.md", *(REPO / "docs").glob("*.md")])
# [text](target) and [text](target "title"); images too. Code spans are removed first.
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def relative_links(page: Path):
    text = CODE.sub("", page.read_text())
    for m in LINK.finditer(text):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, mailto:, an anchor of this page
        line = text.count("\n", 0, m.start()) + 1
        yield line, target.split("#", 1)[0]


def test_the_pages_exist():
    for page in PAGES:
        assert page.is_file(), page
    assert len(PAGES) >= 8  # README, the bench and lab indexes, at least four docs pages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = [f"{page.relative_to(REPO)}:{line}: {target}"
              for line, target in relative_links(page)
              if not (page.parent / target).exists()]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_pattern_finds_links():
    sample = 'See [a](docs/x.md), [b](../y/ "title") and `[not](a link)` or [web](https://e.org).'
    assert [m.group(1) for m in LINK.finditer(CODE.sub("", sample))] == [
        "docs/x.md", "../y/", "https://e.org"]
