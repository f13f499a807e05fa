"""Every module, name, file and folder README.md and docs/*.md cite exists.

What counts as a reference is written once, in tests/helpers/doc_refs.py: in short, a backticked path whose first
part is this repository's or kvseal's (`api/text.py`, `tests/unit/test_x.py::test_y`, `deploy/k8s/`), or a
backticked dotted name that starts with `kvseal`, `benchmarks`, a kvseal package or module, or a class name
(`kvseal.tenancy.tenants.load_api_keys`, `engine.scheduler.Scheduler`, `DisaggBackend.generate`).
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.doc_refs import broken_links, doc_files, references, resolves

# Each of these was written in docs/architecture.md while it no longer existed (issue 31), or is made up.
STALE = """
The router holds the last delta (`DisaggBackend._prefill_settled`); the runner's `ModelRunner._run_fast`; after
`fail_all` nothing is left (`Engine._forget`). See `router/nowhere.py`, `kvseal/engine/gone/`,
`kvseal.tenancy.tenants.load_no_keys`, `engine.scheduler.Nope`, `engine/sampling.no_seed`, `NoSuchClass.method`,
`tests/unit/test_docs_names.py::test_that_was_renamed` and `Engine.step.nothing_below_a_method`.
"""

LIVE = """
`kvseal.tenancy.tenants.load_api_keys`, `engine.scheduler.Scheduler`, `api/text.py`, `kvseal/api/text.py`,
`DisaggRequest.take_delta`, `Engine.seqs` (set in `__init__`), `DecodeConnector.quarantined`, `Engine.step()`,
`api/openai_format.usage`, `kvseal/kernels/`, `tests/unit/test_docs_names.py::test_every_name_the_docs_cite_exists`,
`benchmarks.seal_cost`, `kvseal.requests` (a logger the code names), `lifecycle.Lifecycle`.
"""

NOT_REFERENCES = """
`Scheduler`, `--api-keys`, `usage.prompt_tokens_details.cached_tokens`, `DIR/public/NAME.key`, `/v1/models`,
`qgemm.c`, `~/.cache/kvseal`, `kvseal serve --unified`, `llama_cpp/server/settings.py`, `HOST:PORT`, `q/k/v`.
```
`Engine._forget` inside a fenced block is an example, not a claim.
```
"""


def test_every_name_the_docs_cite_exists() -> None:
    refs = [ref for doc in doc_files() for ref in references(doc.name, doc.read_text())]
    assert len(refs) >= 300, f"only {len(refs)} references found: the rule no longer sees the docs' names"
    missing = [str(ref) for ref in refs if not resolves(ref)]
    assert not missing, "the docs cite names that do not exist:\n" + "\n".join(missing)


def test_a_stale_or_made_up_name_is_a_reference_that_does_not_resolve() -> None:
    refs = references("stale.md", STALE)
    assert len(refs) == 11, [str(r) for r in refs]
    assert [str(r) for r in refs if resolves(r)] == []


def test_live_names_of_every_shape_resolve() -> None:
    refs = references("live.md", LIVE)
    assert len(refs) == 14, [str(r) for r in refs]
    assert [str(r) for r in refs if not resolves(r)] == []


def test_flags_json_paths_placeholders_and_fenced_code_are_not_references() -> None:
    assert references("other.md", NOT_REFERENCES) == []


def test_every_relative_link_of_the_docs_names_a_file_and_heading_that_exist() -> None:
    assert sum(line.count("](") for doc in doc_files() for line in doc.read_text().splitlines()) >= 50
    broken = [b for doc in doc_files() for b in broken_links(doc)]
    assert not broken, "the docs link to files or headings that do not exist:\n" + "\n".join(broken)


def test_a_link_to_a_missing_page_or_heading_is_broken(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Its part: one\n")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md) [ok](a.md#its-part-one) [bad](gone.md) [bad](a.md#no-such-part) [ok](#b)\n"
                   "[bad](#nowhere) [web](https://example.com/x)\n\n# B\n")
    assert broken_links(doc) == ["b.md:1: gone.md", "b.md:1: a.md#no-such-part", "b.md:2: #nowhere"]
