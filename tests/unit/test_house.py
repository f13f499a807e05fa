"""The house by purpose (issue 31).

The router process speaks to the workers in the wire's vocabulary and never loads the engine. Checked in a fresh
interpreter: the router's app built as `kvseal serve` and `kvseal router` build it (cli/front.py http_app over a
DisaggBackend, the faults' hooks and the ledger), then what sys.modules holds.

The house keeps its shape, read from kvseal's source text: no module imports itself through others (a circle), no two
packages import each other (a module of kvseal's top level counts as a package of its own), and no function is
longer than a screen. An import counts wherever it stands: at the top, under TYPE_CHECKING, or inside a function.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROUTER = """
import json, sys
from kvseal.cli.front import http_app
from kvseal.config import ServerConfig
from kvseal.faults import hooks_from_spec
from kvseal.ledger.store import Ledger
from kvseal.model.locate import load_tokenizer
from kvseal.router.disagg import DisaggBackend

tok, name = load_tokenizer(None)
backend = DisaggBackend(tok, name, ["127.0.0.1:1"], ["127.0.0.1:2"], hooks=hooks_from_spec(None, "router"))
app = http_app(backend, ServerConfig())
print(json.dumps(sorted(sys.modules)))
"""


def test_the_router_process_imports_no_torch_and_no_engine() -> None:
    out = subprocess.run([sys.executable, "-c", ROUTER], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.splitlines()[-1])
    assert "kvseal.api.app" in loaded and "kvseal.router.disagg" in loaded  # it did build the router's app
    heavy = [m for m in loaded if m.split(".")[0] == "torch"
             or m.startswith(("kvseal.engine", "kvseal.worker", "kvseal.transfer.", "kvseal.kernels"))]
    assert heavy == [], heavy


# -- the shape of the house: measured from the source text, nothing imported ------------------------------------
ROOT = Path(__file__).resolve().parents[2]
LONGEST = 60  # lines a function may take, from its `def` to its last line


def _sources() -> dict[str, Path]:
    """kvseal's modules by dotted name (a package by its __init__.py)."""
    out = {}
    for path in sorted((ROOT / "kvseal").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, modules: Iterable[str]) -> set[str]:
    """The kvseal modules a file imports anywhere: at the top, under TYPE_CHECKING, or inside a function."""
    known, out = set(modules), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _package(module: str) -> str:
    """kvseal.engine.kv_decode -> engine; a module of kvseal's top level is a package of its own."""
    return module.split(".")[1] if "." in module else module


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_of_kvseal_imports_itself_in_a_circle() -> None:
    assert _circles(_graph()) == []


def test_no_two_packages_of_kvseal_import_each_other() -> None:
    ties: dict[tuple[str, str], set[str]] = {}
    for m, deps in _graph().items():
        for d in deps:
            if _package(m) != _package(d):
                ties.setdefault((_package(m), _package(d)), set()).add(f"{m} -> {d}")
    both = {f"{a} <-> {b}": sorted(ties[a, b] | ties[b, a]) for a, b in ties if a < b and (b, a) in ties}
    assert both == {}


def test_no_function_in_kvseal_is_longer_than_a_screen() -> None:
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted((ROOT / "kvseal").rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > LONGEST]
    assert long == []
