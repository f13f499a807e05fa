"""The names the docs cite, found and resolved (tests/unit/test_docs_names.py checks them).

What counts as a reference: the whole text of one inline code span (`...`, outside fenced code blocks) of one of
these shapes. Anything else in backticks (flags, JSON fields, commands, URLs, metric names) is not a reference.

- A file: a path with a slash ending in .py .c .h .md .json .sh .yaml .yml .toml, optionally with `::test_name`,
  whose first part is a top-level entry of the repository (`kvseal/`, `tests/`, `docs/`, `scripts/`,
  `benchmarks/`, `deploy/`) or a package or module of kvseal (`api/text.py` means `kvseal/api/text.py`). It
  must exist; `::name` needs a `def name(` in the file. A span `::name` alone continues the last file of its line.
- A folder: such a path that ends in `/` (`kvseal/kernels/`, `api/tools/`, `deploy/k8s/`). It must exist.
- A dotted name: identifiers joined by dots, optionally ending in `()`, whose first part is `kvseal`,
  `benchmarks`, a package or top-level module of kvseal (`engine.scheduler.Scheduler` means
  `kvseal.engine.scheduler.Scheduler`), or a capitalised word (`DisaggBackend._prefill_settled`: a class of
  kvseal). A module path with slashes may stand before the dots (`api/openai_format.usage`). It must resolve:
  the longest importable module, then each further part an attribute; a class's attributes include what its
  methods assign to `self` and its annotated fields, its bases' included. A class named alone must be defined at
  the top of some kvseal module. A `kvseal.` name that is no module is also found when the code quotes it
  whole (a logger or a label: `"kvseal.requests"`).

Links: every relative markdown link `[text](target)` outside fenced blocks must name a file that exists (relative
to the doc's folder), and its `#anchor`, if any, a heading of that file (GitHub's slug: lower case, punctuation
dropped, spaces as hyphens). Links to http(s) and mailto are not checked.

Not references: spans with spaces, `=`, `<`, `$`, `~`, `@`, starting with `/` or `..`, with a part in capitals
(a placeholder such as `DIR/public/`), a bare file name (`qgemm.c`), a single identifier (`Scheduler`), and paths
or dotted names whose first part is none of the above (another project's `llama_cpp/server/settings.py`, a JSON
path such as `usage.prompt_tokens_details.cached_tokens`). Write a module's path from `kvseal/` (or from the
repository root) to have it checked.
"""

from __future__ import annotations

import ast
import importlib
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvseal", "benchmarks")
TOP_LEVEL = ("kvseal", "tests", "docs", "scripts", "benchmarks", "deploy")
_IDENT = r"[A-Za-z_]\w*"
_FILE = re.compile(r"^(?P<path>(?:[\w.-]+/)+[\w.-]+\.(?:py|c|h|md|json|sh|yaml|yml|toml))(?:::(?P<test>\w+))?$")
_FOLDER = re.compile(r"^(?:[\w.-]+/)+$")
_DOTTED = re.compile(rf"^(?P<mod>(?:[\w-]+/)*)(?P<dots>{_IDENT}(?:\.{_IDENT})+)(?:\(\))?$")
_CLASSLIKE = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
_BARE_FILE = re.compile(r"^[\w.-]+\.(?:py|c|h|md|json|sh|yaml|yml|toml|txt|gguf|sqlite)$")
_CONTINUED = re.compile(r"^::(\w+)$")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Ref:
    doc: str
    line: int
    text: str
    kind: str  # file, folder or name

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: `{self.text}` ({self.kind})"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def spans(text: str) -> list[tuple[int, str]]:
    """Every inline code span outside fenced blocks, with its line number."""
    return [(number, s.strip()) for number, line in _prose(text) for s in _SPAN.findall(line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    return {slug(line.lstrip("#")) for _, line in _prose(text) if re.match(r"#{1,6} ", line)}


def broken_links(doc: Path) -> list[str]:
    """The relative links of one doc whose file or heading does not exist, as 'doc:line: target'."""
    bad: list[str] = []
    for number, line in _prose(doc.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"(https?|mailto):", target):
                continue
            path, _, anchor = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            if not file.exists() or (anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text()))):
                bad.append(f"{doc.name}:{number}: {target}")
    return bad


@cache
def kvseal_parts() -> frozenset[str]:
    """kvseal's packages and top-level modules: a path or dotted name starting with one is kvseal's."""
    pkg = ROOT / "kvseal"
    return frozenset(
        [p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()]
        + [p.stem for p in pkg.glob("*.py") if not p.stem.startswith("__")]
    )


def _skipped(text: str) -> bool:
    placeholder = any(len(p) > 1 and p.isupper() for p in re.split(r"[/.:]", text))
    return bool(re.search(r"[\s=<>$~@]", text)) or text.startswith(("/", "..")) or placeholder


def _ours(first: str) -> bool:
    return first in TOP_LEVEL or first in kvseal_parts()


def references(doc: str, text: str) -> list[Ref]:
    """Every span of one doc that is a reference, by the rules above."""
    out: list[Ref] = []
    last_file: dict[int, str] = {}
    for number, span in spans(text):
        if _skipped(span):
            continue
        if (m := _CONTINUED.match(span)) and number in last_file:
            out.append(Ref(doc, number, f"{last_file[number]}::{m.group(1)}", "file"))
        elif (m := _FILE.match(span)) and _ours(span.split("/")[0]):
            last_file[number] = m.group("path")
            out.append(Ref(doc, number, span, "file"))
        elif _FOLDER.match(span) and _ours(span.split("/")[0]):
            out.append(Ref(doc, number, span, "folder"))
        elif not _BARE_FILE.match(span) and (m := _DOTTED.match(span)):
            first = (m.group("mod") or m.group("dots")).split("/")[0].split(".")[0]
            if first in PACKAGES or first in kvseal_parts() or (not m.group("mod") and _CLASSLIKE.match(first)):
                out.append(Ref(doc, number, span, "name"))
    return out


@cache
def _classes() -> dict[str, list[tuple[str, ast.ClassDef]]]:
    """Class name -> (module, definition) for every top-level class in kvseal."""
    index: dict[str, list[tuple[str, ast.ClassDef]]] = {}
    for file in sorted((ROOT / "kvseal").rglob("*.py")):
        module = ".".join(file.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(file.read_text()).body:
            if isinstance(node, ast.ClassDef):
                index.setdefault(node.name, []).append((module, node))
    return index


def _instance_attrs(cls: type) -> set[str]:
    """Attributes a class's source gives its instances: annotated fields and `self.x = ...`, bases included."""
    names: set[str] = set()
    for klass in cls.__mro__:
        for _module, node in _classes().get(klass.__name__, []):
            for sub in ast.walk(node):
                if isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Name):
                    names.add(sub.target.id)
                targets = sub.targets if isinstance(sub, ast.Assign) else [getattr(sub, "target", None)]
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def _walk(obj: object, parts: list[str]) -> bool:
    for i, part in enumerate(parts):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, type) and part in _instance_attrs(obj):
            return i == len(parts) - 1  # an instance's attribute: nothing below it can be looked up statically
        else:
            return False
    return True


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@cache
def _quoted_in_code(name: str) -> bool:
    quoted = (f'"{name}"', f"'{name}'")
    files = [*(ROOT / "kvseal").rglob("*.py"), *(ROOT / "scripts").iterdir()]
    return any(q in f.read_text(errors="replace") for f in files if f.is_file() for q in quoted)


def _resolve_name(mod: str, dots: str) -> bool:
    parts = [p for p in mod.split("/") if p] + dots.split(".")
    if not mod and _CLASSLIKE.match(parts[0]):
        classes = [getattr(_import(m), parts[0], None) for m, _ in _classes().get(parts[0], [])]
        return any(c is not None and _walk(c, parts[1:]) for c in classes)
    if parts[0] not in PACKAGES:
        parts = ["kvseal", *parts]
    for cut in range(len(parts), 0, -1):  # the longest importable module, then its attributes
        if (module := _import(".".join(parts[:cut]))) is not None:
            return _walk(module, parts[cut:]) or (parts[0] == "kvseal" and _quoted_in_code(".".join(parts)))
    return False


def resolves(ref: Ref) -> bool:
    if ref.kind == "folder":
        return (ROOT / ref.text).is_dir() or (ROOT / "kvseal" / ref.text).is_dir()
    if ref.kind == "file":
        path, _, test = ref.text.partition("::")
        found = [p for p in (ROOT / path, ROOT / "kvseal" / path) if p.is_file()]
        return bool(found) and (not test or f"def {test}(" in found[0].read_text())
    m = _DOTTED.match(ref.text)
    assert m is not None
    return _resolve_name(m.group("mod"), m.group("dots"))
