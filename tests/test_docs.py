"""The documentation as a site: the generated API reference equals a fresh generation, every
relative link of README.md, CHANGELOG.md and docs/ resolves, and the pages speak to users (no
project-history words in their prose).

The code blocks and command lines of the same pages are run by ``tests/test_readme.py``.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: project-history words in prose (code spans and blocks are left out: ``seeds=`` is an argument,
#: ``commit_chunk`` a method). Upstream issues and papers are cited as owner/repo#N or arXiv ids.
HISTORY = {
    "an issue number of this project": re.compile(r"(?<![\w/.-])#\d+\b|\bissues? \d+\b", re.I),
    "a round": re.compile(r"\b(?:previous|last|this|next|earlier|first|second) rounds?\b|\brounds? \d+\b", re.I),
    "'previous' as history": re.compile(
        r"\bpreviously\b|\bprevious (?:version|release|run|work|attempt|design|implementation|result|figure)s?\b", re.I),
    "a seed as history": re.compile(
        r"\bkvbudget\b|\bthe seed(?:'s| reported| project| experiment| document)\b|\bseed (?:project|document|idea)s?\b",
        re.I),
    "a proposal": re.compile(r"\bproposals?\b", re.I),
    "a commit of this project": re.compile(r"\bcommit(?:ted)? (?:as )?[0-9a-f]{7,40}\b|\bcommits\b", re.I),
}


def load_generator():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prose(text: str) -> str:
    """The text without fenced blocks, code spans and link targets."""
    text = re.sub(r"^```.*?^```[ \t]*$", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def test_the_generated_pages_are_a_fresh_generation():
    """docs/reference/, docs/results/*.md and the README's results table are what
    scripts/gen_docs.py writes now: a docstring, registry or result JSON changed without
    regenerating fails here (fix: python scripts/gen_docs.py)."""
    gen = load_generator()
    files = gen.outputs()
    for folder in ("reference", "results"):
        committed = {p for p in (ROOT / "docs" / folder).glob("*.md")}
        assert committed == {p for p in files if p.parent.name == folder}, "run python scripts/gen_docs.py"
    stale = [str(p.relative_to(ROOT)) for p, text in files.items() if p.read_text() != text]
    assert not stale, f"out of date: {stale}; run python scripts/gen_docs.py"


def test_every_result_number_comes_from_its_json():
    """Each results page names its JSON, and the JSON is in docs/results/ beside it."""
    for page in (ROOT / "docs" / "results").glob("*.md"):
        if page.name != "index.md":
            assert (page.parent / page.name.replace(".md", ".json")).exists(), page


def test_the_registry_tables_list_every_entry():
    from streamkv.policies import POLICIES
    from streamkv.positions import POSITION_MAPS
    from streamkv.quant import KV_FORMATS
    from streamkv_lab.cli import SUBCOMMANDS

    text = (ROOT / "docs" / "reference" / "registries.md").read_text()
    for registry in (POLICIES, KV_FORMATS, POSITION_MAPS, SUBCOMMANDS):
        for name in registry:
            assert re.search(rf"^\| `{re.escape(name)}`", text, re.M), name


def _ignored(path) -> bool:
    """True when git ignores ``path`` (it is on this disk, but not in the repository)."""
    import subprocess

    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    text = re.sub(r"^```.*?^```[ \t]*$", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists() or _ignored(page.parent / path):  # a fresh clone would miss it
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"


def history_hits(text: str) -> list[str]:
    """Each project-history phrase in the prose of ``text``, with its line in the prose."""
    text = prose(text)
    found = []
    for what, pattern in HISTORY.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            if "commit" in what and "arXiv" in text.splitlines()[line - 1]:
                continue  # an upstream repository's commit, cited with its paper
            found.append(f"{what}: {m.group(0)!r} (line {line} of the prose)")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_tells_project_history(page):
    found = history_hits(page.read_text())
    assert not found, f"{page.relative_to(ROOT)}:\n" + "\n".join(found)


def test_the_history_check_can_fail():
    bad = ("As the previous round showed (issue 21, #12), as previously reported, the kvbudget seed, the "
           "proposal, commit 8d40fc2, and `seeds=[1]` in code is fine; sgl-project/sglang#4242 is fine.")
    assert {h.split(":")[0] for h in history_hits(bad)} == set(HISTORY)
    assert not history_hits("sgl-project/sglang#4242, rounding, `seeds=[1]`, committed tokens, a fixed seed (0), "
                            "the previous chunk, Deep Forcing (arXiv 2512.05081, the authors' commit ea9961a)")
