"""``pytest --require-deps``: fail the run when a test skipped because a dependency that the
README's test command installs is missing, instead of passing with skips.

The README's test command (and ``.ci/run``) installs what three groups of tests need: vLLM
(the ``vllm`` extra, and vLLM 0.33's source in ``.vllm-src/``), Redis (Debian's
``redis-server``) and Mooncake (the ``remote`` extra and the system libraries its client
links against). A test of those groups skips where its dependency is missing, with a reason
that says so; this plugin reads every skip's reason, and with ``--require-deps`` a reason
that names a missing dependency of a promised group fails the run. Skips for hardware
(CUDA, an Ascend NPU), for slow variants, for a C compiler or a mount this machine refuses
stay skips.

``tests/conftest.py`` registers the option; ``-p tests.required_deps`` loads the plugin on
its own.
"""

from __future__ import annotations

import platform
import re
import sys
from dataclasses import dataclass, field

import pytest

OPTION = "--require-deps"

#: each promised group, and what a skip reason says where that group's dependency is missing:
#: pytest.importorskip's words, or the reasons the tests give (which name what to install)
_GROUPS = {
    "vLLM": re.compile(
        r"could not import 'vllm\b|No module named 'vllm\b|vLLM [\d.]+ source not found"
    ),
    "Redis": re.compile(r"redis-server|redis-cli|could not import 'redis\b"),
    "Mooncake": re.compile(r"mooncake|libibverbs", re.IGNORECASE),
}


def promised_groups() -> dict[str, re.Pattern[str]]:
    """The groups the README's test command installs on this machine: Mooncake's wheel is
    installed by the ``remote`` extra only on x86_64 with Python 3.11."""
    groups = dict(_GROUPS)
    if not (platform.machine() == "x86_64" and sys.version_info[:2] == (3, 11)):
        del groups["Mooncake"]
    return groups


def missing_group(reason: str) -> str | None:
    """The promised group whose missing dependency ``reason`` (a skip's) names, or None."""
    for group, says_missing in promised_groups().items():
        if says_missing.search(reason):
            return group
    return None


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str | None:
    """A skipped report's reason (not an xfail's), or None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


@dataclass(eq=False)  # hashable by identity, as pluggy needs its plugins to be
class RequireDeps:
    """Collects the skips that name a missing dependency; fails the session on any."""

    found: list[tuple[str, str, str]] = field(default_factory=list)  # (group, test, reason)

    def _note(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        reason = _skip_reason(report)
        group = None if reason is None else missing_group(reason)
        if group is not None and reason is not None:
            self.found.append((group, report.nodeid, reason))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._note(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._note(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.found and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.found:
            return
        groups = sorted({group for group, _, _ in self.found})
        terminalreporter.section(f"{OPTION}: skipped for a missing dependency", red=True)
        for group, test, reason in self.found:
            terminalreporter.line(f"{group}: {test}: {reason}")
        terminalreporter.line(
            f"{len(self.found)} skip(s) of the groups the README's test command installs "
            f"({', '.join(groups)}): install what each reason names, or run without {OPTION}",
            red=True,
        )


def add_option(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        default=False,
        help="fail the run when a test skipped because a dependency the README's test "
        "command installs is missing (vLLM, Redis, Mooncake and its system libraries)",
    )


def configure(config: pytest.Config) -> None:
    if config.getoption(OPTION):
        config.pluginmanager.register(RequireDeps(), "require-deps")


# loaded as a plugin of its own (-p tests.required_deps), it registers itself
pytest_addoption = add_option
pytest_configure = configure
