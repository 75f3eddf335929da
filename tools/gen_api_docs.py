"""Generate docs/api.md from the public API's docstrings and signatures.

    python tools/gen_api_docs.py          # rewrite docs/api.md
    python tools/gen_api_docs.py --check  # exit 1 if docs/api.md is out of date

The public API is ``offload_engine.__all__`` plus the modules in :data:`PUBLIC_MODULES` and
every module under the packages in :data:`PUBLIC_TREES`; this is the one list of them, which
``tests/test_house_rules.py`` checks the package docstring and the imports of ``connectors/``
and ``examples/`` against. Every name in ``__all__`` must be placed in a section below, so a
new export cannot go undocumented; the public modules are documented whole (every public
class and function they define, or for a package with ``__all__``, every class and function
it exports); the adapters under ``offload_engine.connectors`` have their own page. Docstrings
are reStructuredText-flavoured; this script turns their roles (``:class:`X```), double
backticks and ``::`` blocks into Markdown.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"

# (section title, intro, names exported by offload_engine)
SECTIONS: list[tuple[str, str, list[str]]] = [
    (
        "Engines",
        "The async engine, and the facade that hosts it on a private loop thread.",
        ["OffloadingQueueManager", "SyncOffloadingEngine"],
    ),
    (
        "Transfer vocabulary",
        "What a job says: which blocks move from which medium to which.",
        [
            "Medium",
            "Direction",
            "BlockSpec",
            "CacheBlocks",
            "TierBlocks",
            "TransferSpec",
            "TransferResult",
            "JobFence",
            "host_cache_blocks",
            "gpu_blocks",
            "npu_blocks",
            "cpu_blocks",
        ],
    ),
    (
        "Keyed tiers",
        "Blocks named by key (disk, remote store), the object trailer every stored object "
        "carries, and the layout digest that keeps other layouts' bytes out.",
        ["KeyedBlocks", "disk_blocks", "remote_blocks", "Trailer", "LayoutDigest"],
    ),
    (
        "Remote tier",
        "A host tier's blocks in a distributed store (Redis/Valkey, Mooncake Store): the "
        "`CPU -> REMOTE` and `REMOTE -> CPU` handlers, and the store backends they talk to. "
        "The testing kit (`offload_engine.testing`, below) starts real servers for tests.",
        [
            "RemoteTier",
            "RemoteHandler",
            "RemoteTierStats",
            "RemoteStore",
            "RedisStore",
            "RedisStoreConfig",
            "MooncakeStore",
            "MooncakeStoreConfig",
        ],
    ),
    (
        "The disk tier",
        "Files on a local drive behind the CPU <-> DISK handlers: checksummed, published "
        "atomically, capped with LRU eviction, rebuilt from the directory at start.",
        [
            "DiskStore",
            "DiskStoreStats",
            "EvictionPolicy",
            "LRUPolicy",
            "DiskHandler",
            "disk_handlers",
            "page_aligned_tier",
        ],
    ),
    (
        "Layouts and the host tier",
        "How the KV cache is laid out in memory, and the host-memory pool blocks are offloaded to.",
        ["KVLayout", "Region", "HostTier"],
    ),
    (
        "Handlers",
        "The contract a transfer handler implements, and the handlers that ship.",
        [
            "TransferHandler",
            "LaunchedJob",
            "HandlerContext",
            "ThreadPoolHandler",
            "HostCopyHandler",
        ],
    ),
    (
        "Device path",
        "KV cache on an accelerator <-> pinned host tier: the device handler, its configuration "
        "and strategies, the runtimes it is written against, and the host's ledger of the "
        "traffic devices' owners announce (for handlers that borrow peers' links). "
        "`CudaRuntime` and `NpuRuntime` are imported on first use, so `import offload_engine` "
        "loads neither.",
        [
            "DeviceCopyHandler",
            "DeviceHandlerConfig",
            "CopyStrategy",
            "make_device_handlers",
            "pinned_host_tier",
            "DeviceRuntime",
            "CudaRuntime",
            "NpuRuntime",
            "PeerLedger",
        ],
    ),
    ("Statistics", "Snapshots returned by `stats()`.", ["EngineStats", "HandlerStats"]),
]
ERRORS_TITLE = "Errors"
VERSION = "__version__"

#: The public modules below the top level; every other ``offload_engine.*`` module is private.
PUBLIC_MODULES = ("offload_engine.runtimes", "offload_engine.testing")
#: Public packages with every module under them: the adapters to serving systems.
PUBLIC_TREES = ("offload_engine.connectors",)
#: Where the adapters are documented (they need the serving system to import whole).
TREE_PAGES = {"offload_engine.connectors": ("the vLLM adapter", "vllm.md")}

# (module, intro or None for the module's docstring), one per public module. Every
# public class and function the module defines is documented, in source order.
MODULE_SECTIONS: list[tuple[str, str | None]] = [
    (
        "offload_engine.runtimes",
        "Which device runtimes this machine can use, and why not where it cannot "
        "(what `offload-engine info` prints).",
    ),
    ("offload_engine.testing", None),
]


def module_members(module: ModuleType) -> list[object]:
    """Public classes and functions of ``module``, in source order (grouped by defining module).

    A package with ``__all__`` (``offload_engine.testing``) contributes what it exports;
    a plain module what it defines (not what it imports)."""
    exported = getattr(module, "__all__", None)
    if exported is not None:  # a package with a curated facade: what it exports
        found = [
            obj
            for obj in (getattr(module, name) for name in exported)
            if inspect.isclass(obj) or inspect.isfunction(obj)
        ]
    else:
        found = [
            obj
            for name, obj in vars(module).items()
            if not name.startswith("_")
            and (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__ == module.__name__
        ]
    return sorted(found, key=lambda obj: (obj.__module__, inspect.getsourcelines(obj)[1]))


# ------------------------------------------------------------------ text


_ROLE = re.compile(r":(?:class|meth|func|attr|mod|exc|data|obj):`(~?)([^`]+)`")
_QUALIFIED = re.compile(r"\b(?:[a-z_][a-z0-9_]*\.)+([A-Za-z_]\w*)")


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    target = target.removeprefix("offload_engine.")
    if tilde:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def markdown(doc: str) -> str:
    """reST-flavoured docstring text -> Markdown."""
    text = _ROLE.sub(_role, doc)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.strip().startswith(".."):
            head = line.rstrip()[:-2].rstrip()
            if head:
                out.append(head + ":")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out += ["", "```python", *textwrap.dedent("\n".join(block)).strip("\n").split("\n")]
            out += ["```", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


def short(annotation: object) -> str:
    """An annotation as code: strings kept, typing objects shortened to bare names."""
    if annotation is inspect.Parameter.empty:
        return ""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return _QUALIFIED.sub(r"\1", text)


def default_repr(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if callable(value):
        return "..."
    return repr(value)


def signature(obj: Callable[..., Any], *, drop_first: bool = False) -> str:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts: list[str] = []
    star_done = False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        name = p.name
        if p.kind is p.VAR_POSITIONAL:
            name, star_done = f"*{name}", True
        elif p.kind is p.VAR_KEYWORD:
            name = f"**{name}"
        ann = short(p.annotation)
        piece = f"{name}: {ann}" if ann else name
        if p.default is not p.empty:
            piece += f" = {default_repr(p.default)}" if ann else f"={default_repr(p.default)}"
        parts.append(piece)
    ret = short(sig.return_annotation)
    return f"({', '.join(parts)})" + (f" -> {ret}" if ret else "")


def doc_of(obj: object) -> str:
    doc = inspect.getdoc(obj)
    return markdown(doc) if doc else ""


# ------------------------------------------------------------------ objects


def _init_attributes(cls: type) -> list[tuple[str, str]]:
    """Public ``self.x`` attributes set in ``cls.__init__``, with annotations if any."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return []
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError):
        return []
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        targets: list[tuple[ast.expr, str]] = []
        if isinstance(node, ast.AnnAssign):
            targets = [(node.target, ast.unparse(node.annotation))]
        elif isinstance(node, ast.Assign):
            targets = [(t, "") for t in node.targets]
        for target, ann in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and not target.attr.startswith("_")
                and (ann or target.attr not in found)
            ):
                found[target.attr] = ann
    return sorted(found.items())


def _bases(cls: type) -> str:
    bases = getattr(cls, "__orig_bases__", cls.__bases__)
    names = [short(b) if not isinstance(b, type) else b.__name__ for b in bases]
    names = [re.sub(r"[~+-](\w)", r"\1", n) for n in names]  # TypeVar variance marks
    names = [n for n in names if n not in ("object", "ABC", "Enum") and not n.startswith("Generic")]
    return ", ".join(names)


def _member_kind(cls: type, name: str, value: object) -> str | None:
    if name.startswith("_"):
        return None
    if isinstance(value, property):
        return "property"
    if isinstance(value, classmethod):
        return "classmethod"
    if isinstance(value, staticmethod):
        return "staticmethod"
    if inspect.isfunction(value):
        return "async method" if inspect.iscoroutinefunction(value) else "method"
    return None


def _render_attributes(cls: type) -> list[str]:
    """A plain class's annotated class attributes and its public ``self.x`` attributes (a
    dataclass's fields are in its signature instead)."""
    out: list[str] = []
    declared = [
        f"`{n}: {short(a)}" + (f" = {default_repr(cls.__dict__[n])}`" if n in cls.__dict__ else "`")
        for n, a in inspect.get_annotations(cls).items()
        if not n.startswith("_")
    ]
    if declared:
        out += ["Class attributes: " + ", ".join(declared), ""]
    attrs = _init_attributes(cls)
    if attrs:
        shown = [f"`{n}: {short(a)}`" if a else f"`{n}`" for n, a in attrs]
        out += ["Attributes: " + ", ".join(shown), ""]
    return out


def _render_member(cls: type, name: str, kind: str, value: Any) -> list[str]:
    if kind == "property":
        ret = short(inspect.signature(value.fget).return_annotation)
        head = f"property `{name}`" + (f" -> `{ret}`" if ret else "")
        body = doc_of(value)
    else:
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        sig = signature(func, drop_first=kind != "staticmethod")
        prefix = "async " if kind == "async method" else ""
        label = f"{kind} " if kind in ("classmethod", "staticmethod") else ""
        head = f"{label}`{prefix}{name}{sig}`"
        body = doc_of(getattr(cls, name))
    return [f"- {head}", *([textwrap.indent(body, "  "), ""] if body else [""])]


def render_class(cls: type, level: int) -> list[str]:
    h = "#" * level
    out = [f"{h} `{cls.__name__}`", ""]
    bases = _bases(cls)
    protocol = bool(getattr(cls, "_is_protocol", False))
    if issubclass(cls, enum.Enum):
        out += ["An enum." + (f" Bases: `{bases}`" if bases else ""), ""]
    elif not protocol and (dataclasses.is_dataclass(cls) or "__init__" in cls.__dict__):
        sig = signature(cls).removesuffix(" -> None")
        out += ["```python", f"class {cls.__name__}{sig}", "```", ""]
        if bases:
            out += [f"Bases: `{bases}`", ""]
    elif bases:
        out += [f"Bases: `{bases}`", ""]
    doc = doc_of(cls)
    if doc:
        out += [doc, ""]
    if issubclass(cls, enum.Enum):
        out += ["| member | value |", "|---|---|"]
        out += [f"| `{m.name}` | `{m.value!r}` |" for m in cls]
        out.append("")
        return out
    if not dataclasses.is_dataclass(cls):
        out += _render_attributes(cls)
    for name, value in cls.__dict__.items():
        kind = _member_kind(cls, name, value)
        if kind is not None:
            out += _render_member(cls, name, kind, value)
    return out


def render_function(func: Callable[..., Any], level: int) -> list[str]:
    h = "#" * level
    out = [
        f"{h} `{func.__name__}`",
        "",
        "```python",
        f"{func.__name__}{signature(func)}",
        "```",
        "",
    ]
    doc = doc_of(func)
    return out + ([doc, ""] if doc else [])


def render_object(obj: object, level: int) -> list[str]:
    if isinstance(obj, type):
        return render_class(obj, level)
    if callable(obj):
        return render_function(obj, level)
    raise TypeError(f"cannot document {obj!r}")


def render_errors(errors: ModuleType) -> list[str]:
    out = [
        "| error | bases | raised when |",
        "|---|---|---|",
    ]
    for name, obj in vars(errors).items():
        if (
            isinstance(obj, type)
            and issubclass(obj, Exception)
            and obj.__module__ == errors.__name__
        ):
            bases = ", ".join(f"`{b.__name__}`" for b in obj.__bases__)
            doc = " ".join(doc_of(obj).split())
            out.append(f"| `{name}` | {bases} | {doc} |")
    return [*out, ""]


# ------------------------------------------------------------------ page


def render() -> str:
    import offload_engine
    from offload_engine import errors

    error_names = {
        n for n, o in vars(errors).items() if isinstance(o, type) and issubclass(o, Exception)
    }
    placed = {n for _, _, names in SECTIONS for n in names} | error_names | {VERSION}
    missing = sorted(set(offload_engine.__all__) - placed)
    stale = sorted(n for _, _, names in SECTIONS for n in names if n not in offload_engine.__all__)
    if missing or stale:
        raise SystemExit(
            f"tools/gen_api_docs.py: place these exports in SECTIONS: {missing}; "
            f"drop these, no longer exported: {stale}"
        )

    documented = tuple(m for m, _ in MODULE_SECTIONS)
    if documented != PUBLIC_MODULES or set(TREE_PAGES) != set(PUBLIC_TREES):
        raise SystemExit(
            "tools/gen_api_docs.py: MODULE_SECTIONS and TREE_PAGES must cover PUBLIC_MODULES "
            "and PUBLIC_TREES, in order"
        )
    modules = ", ".join(f"`{m}`" for m in PUBLIC_MODULES)
    trees = ", ".join(
        f"every module under `{tree}` ({what}: [{page}]({page}))"
        for tree, (what, page) in TREE_PAGES.items()
    )
    out = [
        "# API reference",
        "",
        "<!-- Generated by tools/gen_api_docs.py from the docstrings; do not edit by hand. -->",
        "",
        "Generated from the docstrings and signatures by `python tools/gen_api_docs.py`;",
        "`tests/test_docs.py` fails when this page is out of date. To change it, change the",
        "docstrings and rerun the script.",
        "",
        f"The public API is what `offload_engine` exports (`offload_engine.__all__`, version "
        f"`{offload_engine.__version__}`),",
        f"the modules {modules}, and {trees}.",
        "Everything else is private and may change without notice.",
        "",
        "## Contents",
        "",
    ]
    titles = [t for t, _, _ in SECTIONS] + [ERRORS_TITLE] + [m for m, _ in MODULE_SECTIONS]
    for title in titles:
        anchor = re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")
        out.append(f"- [{title}](#{anchor})")
    out.append("")
    for title, intro, names in SECTIONS:
        out += [f"## {title}", "", intro, ""]
        for name in names:
            out += render_object(getattr(offload_engine, name), 3)
    out += [
        f"## {ERRORS_TITLE}",
        "",
        markdown(inspect.getdoc(errors) or ""),
        "",
        *render_errors(errors),
    ]
    for module_name, module_intro in MODULE_SECTIONS:
        module = importlib.import_module(module_name)
        intro_text = module_intro or markdown(inspect.getdoc(module) or "")
        out += [f"## {module_name}", "", intro_text, ""]
        for obj in module_members(module):
            out += render_object(obj, 3)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip("\n") + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Generate docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run python tools/gen_api_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
