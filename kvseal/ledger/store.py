"""The forensic ledger's SQLite file: one row per request that ended, per process that saw it (router, prefill,
decode, unified). Standard library `sqlite3` in WAL mode, so the processes of a fleet share one file and a reader
(`kvseal incidents`) never blocks them.

Rows hold ids, times, page ids, owners, verification results and who wrote the KV a request read: never prompt or
output text (the record type has no field that could carry it). Writes go through a queue to one thread that
commits in batches, off the engine's step.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sqlite3
import threading
from pathlib import Path
from typing import Any

import msgspec

log = logging.getLogger("kvseal.ledger")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    request_id TEXT NOT NULL,
    role TEXT NOT NULL,            -- router | prefill | decode | unified: the process that wrote the row
    worker TEXT NOT NULL,          -- that process's endpoint
    tenant TEXT NOT NULL,          -- the tenant's name (never a key)
    received REAL NOT NULL,        -- unix seconds
    ended REAL NOT NULL,
    prefill_worker TEXT,
    decode_worker TEXT,
    reservation_id TEXT,
    state TEXT NOT NULL,           -- finished | rejected | aborted | failed | handed_off (prefill, after the ack)
    error_code TEXT,
    pages TEXT NOT NULL,           -- JSON [[page, owner request at read time, owner epoch], ...]
    verification TEXT,             -- JSON, decode: {"result": ok|failed|unverified, "field", "pages": [...]}
    cached TEXT NOT NULL,          -- JSON [[page, namespace (tenant, cache_salt) as hex, writer request], ...]
    foreign_reads TEXT NOT NULL,   -- JSON [[page, lo, hi, source request, source tenant, kind], ...]
    foreign_tokens INTEGER NOT NULL,
    drafted INTEGER NOT NULL DEFAULT 0,   -- speculative decoding: draft tokens verified for this request here
    accepted INTEGER NOT NULL DEFAULT 0   -- of them, kept (per engine: sum by worker)
);
CREATE INDEX IF NOT EXISTS requests_ended ON requests (ended);
CREATE INDEX IF NOT EXISTS requests_foreign ON requests (foreign_tokens);
"""


class LedgerRow(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str
    role: str
    worker: str
    tenant: str
    received: float
    ended: float
    state: str
    error_code: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
    reservation_id: str | None = None
    pages: list[tuple[int, str, int]] = []
    verification: dict[str, Any] | None = None
    cached: list[tuple[int, str, str]] = []
    # (page, first slot, end slot, source request ("" unknown), source tenant, kind: prompt | generated |
    # transfer | unwritten)
    foreign_reads: list[tuple[int, int, int, str, str, str]] = []
    drafted: int = 0  # speculative decoding (engine/drafts.py): draft tokens verified, and of them kept
    accepted: int = 0

    @property
    def foreign_tokens(self) -> int:
        return sum(hi - lo for _, lo, hi, *_ in self.foreign_reads)


DATA_DIR_ENV = "KVSEAL_DATA_DIR"


def default_path() -> str:
    """Where `kvseal serve` keeps its ledger: $KVSEAL_DATA_DIR, else $XDG_DATA_HOME/kvseal, else
    ~/.local/share/kvseal; the file is ledger.sqlite there."""
    base = os.environ.get(DATA_DIR_ENV) or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "kvseal")
    return os.path.join(base, "ledger.sqlite")


def connect(path: str | Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.executescript(SCHEMA)
    have = {row[1] for row in db.execute("PRAGMA table_info(requests)")}
    for column in ("drafted", "accepted"):  # a ledger written before speculative decoding: its rows count 0
        if column not in have:
            db.execute(f"ALTER TABLE requests ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0")
    return db


_COLUMNS = ("request_id", "role", "worker", "tenant", "received", "ended", "prefill_worker", "decode_worker",
            "reservation_id", "state", "error_code", "pages", "verification", "cached", "foreign_reads",
            "foreign_tokens", "drafted", "accepted")
_INSERT = f"INSERT INTO requests ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"


def _values(r: LedgerRow) -> tuple[Any, ...]:
    return (r.request_id, r.role, r.worker, r.tenant, r.received, r.ended, r.prefill_worker, r.decode_worker,
            r.reservation_id, r.state, r.error_code, json.dumps(r.pages), None if r.verification is None
            else json.dumps(r.verification), json.dumps(r.cached), json.dumps(r.foreign_reads), r.foreign_tokens,
            r.drafted, r.accepted)


class Ledger:
    """Appends rows from any thread; one background thread writes them. close() writes what is queued."""

    def __init__(self, path: str | Path, flush_s: float = 0.2) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # a folder it makes: the owner's alone
        # tenant names and page owners: readable by the server's user only (SQLite gives -wal/-shm the same mode)
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        os.chmod(self.path, 0o600)
        connect(self.path).close()  # a path that cannot hold a database fails here, at start
        self._q: queue.Queue[LedgerRow | None] = queue.Queue()
        self._flush_s = flush_s
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="kvseal-ledger", daemon=True)
        self._thread.start()

    def add(self, row: LedgerRow) -> None:
        self._q.put(row)

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        db = connect(self.path)
        done = False
        while not done:
            batch: list[LedgerRow] = []
            try:
                item = self._q.get(timeout=self._flush_s)
                while True:
                    if item is None:
                        done = True
                        break
                    batch.append(item)
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            if batch:
                try:
                    with db:
                        db.executemany(_INSERT, [_values(r) for r in batch])
                    self.written += len(batch)
                except sqlite3.Error:
                    log.exception("the ledger could not write %d row(s) to %s", len(batch), self.path)
        db.close()
