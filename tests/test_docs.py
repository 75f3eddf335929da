"""The docs set: api.md matches the docstrings, the README links every page, links resolve."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
# Pages written on other branches, linked before they are merged. Drop each once it exists.
PENDING: set[str] = set()

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_api_docs", ROOT / "tools" / "gen_api_docs.py"
    )
    if spec is None or spec.loader is None:
        raise ImportError("tools/gen_api_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text()))


def _anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _FENCE.sub("", page.read_text()).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_api_md_is_up_to_date() -> None:
    current = (DOCS / "api.md").read_text()
    assert current == _generator().render(), (
        "docs/api.md is out of date: run python tools/gen_api_docs.py"
    )


def test_readme_links_every_doc_page() -> None:
    linked = {(ROOT / t.split("#")[0]).resolve() for t in _links(README)}
    unlinked = [p.relative_to(ROOT).as_posix() for p in _pages() if p.resolve() not in linked]
    assert unlinked == []
    assert len(_pages()) >= 7  # architecture, api, cli, performance, three guides


def test_relative_links_and_anchors_resolve() -> None:
    broken = []
    for page in [README, *_pages()]:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            rel = resolved.relative_to(ROOT).as_posix()
            if not resolved.exists():
                if rel not in PENDING:
                    broken.append(f"{page.relative_to(ROOT)}: {target}")
                continue
            if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def _pip_commands(text: str) -> set[str]:
    """Every ``pip install``/``pip uninstall`` in ``text``, without --quiet/--yes flags."""
    found = set()
    for m in re.finditer(r"pip (?:install|uninstall) [^&\n]+", text):
        words = [w for w in m.group(0).split() if w not in ("--quiet", "--yes", "-y")]
        found.add(" ".join(words).replace("|| true", "").strip())
    return found


def test_ci_installs_with_the_readme_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    ci_cmds = {c for c in _pip_commands(ci) if "--upgrade pip" not in c}
    assert ci_cmds, "no pip command found in .ci/run"
    assert ci_cmds <= _pip_commands(readme), ci_cmds - _pip_commands(readme)
    assert "python -m pytest" in ci
