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


def api_docs_generator() -> ModuleType:
    """tools/gen_api_docs.py, loaded as a module (tools/ is not a package)."""
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
    assert current == api_docs_generator().render(), (
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


#: performance.md is the page of current figures; superseded ones are left to git history
PERFORMANCE_MAX_LINES = 600


def test_performance_md_keeps_to_its_length() -> None:
    lines = (DOCS / "performance.md").read_text().splitlines()
    assert len(lines) <= PERFORMANCE_MAX_LINES, (
        f"docs/performance.md has {len(lines)} lines (at most {PERFORMANCE_MAX_LINES}): "
        "replace superseded figures instead of adding beside them"
    )


def _cited_results(text: str) -> set[str]:
    """The ``benchmarks/results/`` files ``text`` names (``a-{1,2}.json`` is two)."""
    names = set()
    for m in re.finditer(r"benchmarks/results/([\w.{},-]+)", text):
        name = m.group(1).rstrip(".,")
        brace = re.search(r"\{([^}]*)\}", name)
        if brace is None:
            names.add(name)
            continue
        for part in brace.group(1).split(","):
            names.add(name[: brace.start()] + part + name[brace.end() :])
    return names


def test_results_cited_by_performance_md_exist() -> None:
    cited = _cited_results((DOCS / "performance.md").read_text())
    assert cited, "performance.md cites no benchmarks/results file"
    missing = sorted(n for n in cited if not (ROOT / "benchmarks" / "results" / n).is_file())
    assert missing == []


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


def _readme_test_command() -> str:
    [line] = [ln for ln in README.read_text().splitlines() if "&& python -m pytest" in ln]
    return line


def test_readme_test_command_installs_the_system_packages_ci_installs() -> None:
    """The README's test command installs the Debian packages ``.ci/run`` checks for, and
    both run pytest with ``--require-deps``: a fresh machine that follows the README runs
    the Redis and Mooncake tests, or fails saying what is missing."""
    ci = (ROOT / ".ci" / "run").read_text()
    [required] = re.findall(r'^REQUIRED="(.*?)"', ci, re.S | re.M)
    ci_packages = [entry.split(":")[1] for entry in required.split()]
    command = _readme_test_command()
    [apt] = re.findall(r"sudo apt-get install -y ([^&]+) &&", command)
    assert apt.split() == ci_packages
    assert command.startswith("sudo apt-get update && sudo apt-get install -y ")
    assert command.endswith("python -m pytest --require-deps")
    assert "\npython -m pytest --require-deps\n" in ci


def test_readme_test_command_prepares_what_ci_prepares() -> None:
    """Every tool CI runs before the tests (the vLLM 0.33 source fetch) is in the README's
    test command too, before pytest: a reader gets CI's tests, not CI's minus some skips."""
    ci = (ROOT / ".ci" / "run").read_text()
    tools = set(re.findall(r"python (tools/\S+\.py[^|&;}\\\n]*)", ci))
    assert tools, "no tools/ command found in .ci/run"
    command = _readme_test_command()
    for tool in tools:
        assert f"python {tool.strip()} && " in command, tool


def test_install_page_gives_the_readme_commands() -> None:
    page = (DOCS / "install.md").read_text()
    [block] = re.findall(r"^```bash\n(.*?)^```", page, re.S | re.M)[:1]
    commands = _pip_commands(re.sub(r"#.*", "", block))
    assert any("[dev,vllm,remote]" in c for c in commands), commands
    assert commands <= _pip_commands(README.read_text()), commands - _pip_commands(
        README.read_text()
    )


def test_cli_page_lists_every_option() -> None:
    import argparse

    from offload_engine.cli import build_parser

    page = (DOCS / "cli.md").read_text()
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    missing = []
    for name in ("demo", "bench"):
        for action in sub.choices[name]._actions:
            long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
            if long and f"| `{long[0]}" not in page and f"`{long[-1]} " not in page:
                missing.append(f"{name} {long[0]}")
            if action.choices and long:
                row = f"| `{long[0]} {{{','.join(map(str, action.choices))}}}`"
                if row not in page:
                    missing.append(f"{name} {row}")
    assert missing == []


def test_readme_and_cli_page_name_every_subcommand() -> None:
    """The README and docs/cli.md count the command's subcommands as ``--help`` lists them,
    and name each one."""
    import argparse

    from offload_engine.cli import build_parser

    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    names = list(sub.choices)
    words = ["no", "one", "two", "three", "four", "five", "six"]
    readme, page = README.read_text(), (DOCS / "cli.md").read_text()
    assert f"It has {words[len(names)]} subcommands:" in page
    assert f"The same command has {words[len(names) - 1]} more subcommands:" in readme
    for name in names:
        assert f"| `offload-engine {name}` |" in page, name
        assert f"offload-engine {name}" in readme, name


def _undefined_names(code: str) -> set[str]:
    """Names a snippet reads but never imports, assigns or defines (builtins aside)."""
    import ast
    import builtins

    tree = ast.parse(code)
    bound = set(dir(builtins))
    loaded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return loaded - bound


def test_tiers_page_snippets_import_every_name_they_use() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", (DOCS / "tiers.md").read_text(), re.S | re.M)
    assert blocks
    assert [_undefined_names(b) for b in blocks] == [set() for _ in blocks]
    assert _undefined_names("x = os.environ['A']\n") == {"os"}
