"""The forensic ledger: page provenance, what a request read and whose KV it was, and `kvseal incidents`."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from kvseal.cli import main
from kvseal.config import CacheConfig, EngineConfig, LedgerConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.kv.provenance import PageProvenance, Segment, Writer
from kvseal.ledger.incidents import find
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateRequest, SamplingParams
from tests.helpers.halves import DecodeHalf, PrefillHalf, decode_engine, prefill_engine

A = Writer("a", "acme", 1, "prompt")
B = Writer("b", "globex", 2, "generated")


def test_provenance_overwrites_splits_and_scrubs() -> None:
    prov = PageProvenance(num_pages=4, page_size=8)
    prov.wrote_positions([2, 0], 0, 12, A)  # page 2 slots 0-7, page 0 slots 0-3
    prov.wrote(2, 3, 5, B)
    assert list(prov.not_written_by([2, 0], 0, 16, "a")) == [
        (2, Segment(3, 5, B)), (0, Segment(4, 8, None))]
    assert list(prov.not_written_by([2], 0, 8, "b")) == [(2, Segment(0, 3, A)), (2, Segment(5, 8, A))]
    prov.wrote(2, 0, 8, A)  # a decode step extending a run keeps one segment
    assert list(prov.not_written_by([2], 0, 8, "a")) == []
    prov.scrubbed([2])
    assert list(prov.not_written_by([2], 0, 8, "a")) == [(2, Segment(0, 8, None))]


def _cfg(tmp: Path, name: str, scrub: bool = True, pool: int = 48, cache: bool = True) -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=128),
                        cache=CacheConfig(page_size=4, pool_tokens=pool, scrub=scrub, prefix_cache=cache),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64), ledger=LedgerConfig(str(tmp / name)))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _drain(e: Engine) -> dict[str, str]:
    out: dict[str, str] = {}
    while e.has_work():
        for d in e.step():
            assert d.error is None, d.error
            out[d.request_id] = out.get(d.request_id, "") + d.text
    return out


def _rows(path: Path) -> dict[tuple[str, str], dict[str, object]]:
    db = sqlite3.connect(path)
    db.row_factory = sqlite3.Row
    rows = {(r["role"], r["request_id"]): dict(r) for r in db.execute("SELECT * FROM requests")}
    db.close()
    return rows


def test_unified_rows_record_pages_and_cache_reads_never_text(tiny: Checkpoint, tmp_path: Path) -> None:
    e = Engine(_cfg(tmp_path, "u.sqlite", pool=256), tiny)
    ids = _ids(30, 1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    e.add_request(GenerateRequest("first", ids, params, tenant="acme"))
    texts = _drain(e)
    e.add_request(GenerateRequest("second", ids, params, tenant="acme"))  # 7 full pages from the cache
    texts |= _drain(e)
    assert e.ledger is not None
    e.ledger.close()
    rows = _rows(tmp_path / "u.sqlite")
    first, second = rows[("unified", "first")], rows[("unified", "second")]
    assert first["state"] == second["state"] == "finished" and first["tenant"] == "acme"
    assert first["foreign_tokens"] == second["foreign_tokens"] == 0
    pages = json.loads(str(first["pages"]))
    assert len(pages) == -(-(30 + 7) // 4) and all(who == "first" and epoch == 0 for _, who, epoch in pages)
    cached = json.loads(str(second["cached"]))
    assert len(cached) == 7 and all(writer == "first" for _, _, writer in cached)
    assert {p for p, _, _ in cached} <= {p for p, _, _ in pages}
    blob = (tmp_path / "u.sqlite").read_bytes() + b"".join(
        f.read_bytes() for f in tmp_path.glob("u.sqlite-*"))
    for text in texts.values():
        assert len(text) >= 4 and text.encode() not in blob  # never output text
    assert find(str(tmp_path / "u.sqlite")) == (2, [])


def _handoff(p: PrefillHalf, d: DecodeHalf, rid: str, ids: list[int], tenant: str, max_tokens: int,
             placeholder: bool = False) -> None:
    """rid through reserve -> prefill -> accept -> decode; `placeholder`: the 2026 bug (prefill computes one token,
    decode takes it unverified)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = d.kv.reserve(GenerateRequest(rid, ids, params, tenant=tenant), 60.0, "tcp://test")
    sent = GenerateRequest(rid, ids[:1], SamplingParams(max_tokens=1, temperature=0.0), tenant=tenant) \
        if placeholder else GenerateRequest(rid, ids, params, tenant=tenant)
    p.add_request(sent)
    while not (ready := p.kv.take_ready()):
        p.step()
    (h,) = ready
    manifest, payload = p.kv.package(h, res)
    d.kv.verify_kv = lambda: not placeholder
    d.kv.accept(manifest, payload)
    p.kv.end_handoff(rid, None)
    _drain(d)


@pytest.mark.parametrize("scrub", [False, True])
def test_a_placeholder_reads_foreign_kv_and_incidents_names_it(tiny: Checkpoint, tmp_path: Path,
                                                               scrub: bool) -> None:
    p = prefill_engine(_cfg(tmp_path, "l.sqlite", cache=False), tiny)
    d = decode_engine(_cfg(tmp_path, "l.sqlite", scrub=scrub), tiny)
    _handoff(p, d, "A", _ids(36, 2), "acme", 6)  # decode pages 0-10: prompt 0-35, generated 36-41
    _handoff(p, d, "B", _ids(44, 3), "globex", 4, placeholder=True)  # reserved: page 11, then pages 0-9
    for e in (p, d):
        assert e.ledger is not None
        e.ledger.close()
    path = tmp_path / "l.sqlite"
    rows = _rows(path)
    assert json.loads(str(rows[("decode", "A")]["verification"]))["result"] == "ok"
    assert json.loads(str(rows[("decode", "B")]["verification"]))["result"] == "unverified"
    assert rows[("prefill", "A")]["state"] == "handed_off" and rows[("decode", "A")]["reservation_id"]
    reads = json.loads(str(rows[("decode", "B")]["foreign_reads"]))
    # B read positions 1..43: 3 unclaimed slots of the page that came, then 40 on pages it never got KV for
    assert sum(hi - lo for _, lo, hi, *_ in reads) == 43
    kinds = {(src, tenant, kind) for *_, src, tenant, kind in reads}
    if scrub:  # freed pages were zeroed: wrong output, but nobody else's data
        assert kinds == {("", "", "transfer"), ("", "", "unwritten")}
    else:
        assert kinds == {("", "", "transfer"), ("A", "acme", "prompt"), ("A", "acme", "generated")}
    total, found = find(str(path))
    assert total == 4 and [(i.request_id, i.role, i.tenant) for i in found] == [("B", "decode", "globex")]
    assert main(["incidents", str(path)]) == 1
    ended = found[0].ended
    assert find(str(path), since=ended + 1) == (0, [])  # --since / --until bound the window by end time
    assert main(["incidents", str(path), "--until", datetime.fromtimestamp(ended - 60, UTC).isoformat()]) == 0
    assert main(["incidents", str(path), "--since", str(ended - 60), "--until", str(ended + 60)]) == 1


def test_incidents_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["incidents", str(tmp_path / "missing.sqlite")]) == 2
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    assert main(["incidents", str(tmp_path / "junk.sqlite")]) == 2
    assert "cannot read the ledger" in capsys.readouterr().err


def test_the_ledger_is_readable_by_the_servers_user_alone(tmp_path: Path) -> None:
    """It names tenants and whose KV each request read: under the usual umask 022 it was 0644, readable by anyone
    on the host (seal 11: nothing tenant-visible outside the operator)."""
    import os
    import stat

    from kvseal.ledger.store import Ledger

    old = os.umask(0o022)
    try:
        path = tmp_path / "made" / "ledger.sqlite"
        Ledger(path).close()
        existing = tmp_path / "open.sqlite"
        existing.touch(mode=0o644)
        Ledger(existing).close()
    finally:
        os.umask(old)
    for f in (path, existing, *tmp_path.glob("**/*-wal"), *tmp_path.glob("**/*-shm")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
