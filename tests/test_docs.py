"""The README and docs/ stay short, current and pointing at real files.

- README.md is at most 10 KB;
- the config reference in docs/serving.md is what ``runtime/config_reference.py`` renders from ``runtime/config.py``;
- every relative link and every backticked repository path in README.md and docs/*.md exists, and every
  ``#anchor`` into a markdown page names one of its headings;
- no history notes (the research log's numbered "stop N" entries) outside zoo/TRAINING.md;
- the code cites docs/design.md, not the design card it grew from.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specula.runtime import config_reference

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_LIMIT = 10 * 1024

# first components a backticked path must start with to be checked (the repository's own folders and files)
TOP = {"runtime", "targets", "drafters", "training", "zoo", "research", "world", "protos", "tests", "docs",
       "reports", "specula", ".ci", "cluster.yaml", "Makefile", "pyproject.toml", "README.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.\-/]+$")
HISTORY = re.compile(r"\bstops? \d+", re.IGNORECASE)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


def _prose(page: Path) -> str:
    """The page without its fenced code blocks (commands there may name files a user creates)."""
    return re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_readme_is_at_most_10_kb():
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail into docs/"


def test_config_reference_is_current():
    page = ROOT / "docs" / "serving.md"
    current = config_reference.region(page.read_text(encoding="utf-8"))
    assert current == config_reference.render(), (
        f"docs/serving.md's config reference is stale: run `{config_reference.REFRESH}` to refresh it")


def test_config_reference_covers_every_field_of_every_model():
    text = config_reference.render()
    for cls, _ in config_reference._models(config_reference.SpeculaConfig):
        section = text.split(f"### {cls.__name__}\n", 1)[1].split("\n### ", 1)[0]
        for name in cls.model_fields:
            assert f"| `{name}` |" in section, f"{cls.__name__}.{name} missing from the reference"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_exist(page: Path):
    missing = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            missing.append(f"{target} (no such heading)")
    assert not missing, f"{_rel(page)} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_backticked_repository_paths_exist(page: Path):
    missing = []
    for span in CODE.findall(_prose(page)):
        if not PATH.match(span) or span.split("/")[0] not in TOP or "/" not in span and "." not in span:
            continue
        if not (ROOT / span.rstrip("/")).exists():
            missing.append(span)
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_history_notes(page: Path):
    found = HISTORY.findall(page.read_text(encoding="utf-8"))
    assert not found, f"{_rel(page)} has history notes {found}: they belong in zoo/TRAINING.md"


def test_code_cites_docs_design_not_the_design_card():
    stale = []
    for folder in ("runtime", "targets", "drafters", "training", "world", "zoo", "protos", "specula"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".proto") and "_generated" not in path.parts:
                if "DESIGN.md" in path.read_text(encoding="utf-8"):
                    stale.append(_rel(path))
    assert not stale, f"these cite DESIGN.md; the project's design page is docs/design.md: {stale}"
