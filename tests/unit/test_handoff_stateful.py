"""The handoff state machine under random interleavings (hypothesis stateful), on the real engines.

A prefill engine and a decode engine (tiny model) are driven through the handoff the way the workers drive
them (reserve, prefill, package, accept/verify, release, abort, expire), with faults mixed in. After every
step: seal 1 (each request has at most one final outcome, and nothing after it), seal 3 (a request that ended
before its handoff never had KV accepted by decode) and seal 8 (books balance; idle pools are full).
"""

from __future__ import annotations

import time

import msgspec
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.engine.sequence import Sequence
from kvseal.errors import InvalidRequest, KvsealError, RequestAborted, TransferVerificationFailed
from kvseal.transfer.manifest import PagePayload
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation

from .conftest import tiny_checkpoint

CK = tiny_checkpoint()


def _cfg(pool: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=128), cache=CacheConfig(page_size=4, pool_tokens=pool),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32))


class Handoffs(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p = Engine(_cfg(256), CK, role="prefill")
        self.d = Engine(_cfg(256), CK, role="decode")
        self.pk, self.dk = PrefillConnector(self.p), DecodeConnector(self.d)
        self.n = 0
        self.reservations: dict[str, Reservation] = {}  # reserved on decode, not yet sent to prefill
        self.prefilling: dict[str, Reservation] = {}  # sent to prefill
        self.ready: dict[str, Sequence] = {}  # prefilled, KV not yet delivered
        self.accepted: set[str] = set()  # decode accepted (verified) KV for these
        self.finals: dict[tuple[str, str], GenerateDelta | None] = {}  # (engine, request) -> its one final
        self.after_final: list[tuple[str, str]] = []

    # -- helpers -------------------------------------------------------------------------------------
    def _collect(self, side: str, deltas: list[GenerateDelta]) -> None:
        """Each engine's view of a request ends once: nothing may follow its final delta."""
        for d in deltas:
            if (side, d.request_id) in self.finals:
                self.after_final.append((side, d.request_id))
            if d.final is not None:
                self.finals[(side, d.request_id)] = d

    def _pump_prefill(self) -> None:
        self._collect("prefill", self.p.step())
        for seq in self.pk.take_ready():
            self.ready[seq.request_id] = seq

    # -- rules ---------------------------------------------------------------------------------------
    @rule(prompt_len=st.integers(1, 140), max_tokens=st.integers(1, 12))
    def reserve(self, prompt_len: int, max_tokens: int) -> None:
        self.n += 1
        rid = f"r{self.n}"
        ids = torch.randint(2, 64, (prompt_len,), generator=torch.Generator().manual_seed(self.n)).tolist()
        req = GenerateRequest(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        try:
            self.reservations[rid] = self.dk.reserve(req, timeout_s=60.0, kv_endpoint="tcp://test")
        except KvsealError:
            self.finals[("decode", rid)] = None  # refused at reservation: nothing held (see the invariants)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)))
        res = self.reservations.pop(rid)
        seq = self.dk.reserved[rid]
        self.p.add_request(GenerateRequest(rid, seq.prompt_ids, seq.params))
        self.prefilling[rid] = res

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def prefill_refuses(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reservations)))
        self.reservations.pop(rid)
        self.dk.release(rid, InvalidRequest("refused by prefill"), rejected=True)

    @rule()
    def prefill_step(self) -> None:
        self._pump_prefill()

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), fault=st.sampled_from([None, "flip", "nonce", "short_tokens"]))
    def transfer(self, data: st.DataObject, fault: str | None) -> None:
        rid = data.draw(st.sampled_from(sorted(self.ready)))
        h = self.ready.pop(rid)
        res = self.prefilling.pop(rid)
        manifest, payload = self.pk.package(h, res)
        still_reserved = rid in self.dk.reserved
        if fault == "flip":
            k = payload.k.clone()
            k[0] ^= 1
            payload = PagePayload(k, payload.v, payload.num_pages)
        elif fault == "nonce":
            manifest = msgspec.structs.replace(manifest, nonce="f" * 32)
        elif fault == "short_tokens":
            manifest = msgspec.structs.replace(manifest, num_tokens=manifest.num_tokens - 1)
        try:
            self.dk.accept(manifest, payload)
        except TransferVerificationFailed as err:
            assert fault is not None or not still_reserved, err  # refused: corrupted, or expired/aborted
            self.pk.end_handoff(rid, err)
            return
        assert fault is None and still_reserved, "a corrupted or unreserved handoff was accepted"
        self.accepted.add(rid)
        self.pk.end_handoff(rid, None)

    @rule()
    def decode_step(self) -> None:
        self._collect("decode", self.d.step())

    @precondition(lambda self: self.d.seqs or self.p.seqs)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.d.seqs) | set(self.p.seqs))))
        cause = RequestAborted("client disconnected")
        self.d.abort(rid, cause)
        self.p.abort(rid, cause)
        for table in (self.reservations, self.prefilling, self.ready):
            table.pop(rid, None)

    @rule()
    def reservations_time_out(self) -> None:
        self.dk.expire_reservations(time.monotonic() + 3600)
        for rid in list(self.reservations):
            self.reservations.pop(rid)

    # -- invariants ----------------------------------------------------------------------------------
    @invariant()
    def seal1_one_outcome(self) -> None:
        assert not self.after_final, f"output after the final outcome: {self.after_final}"
        for d in self.d.seqs.values():
            assert not d.life.terminal

    @invariant()
    def seal3_nothing_used_before_verification(self) -> None:
        for rid, seq in self.dk.reserved.items():
            assert rid not in self.accepted and seq.num_computed == 0
        for (side, rid), d in self.finals.items():
            if side == "decode" and (d is None or d.final == "rejected"):
                assert rid not in self.accepted and (d is None or d.token_ids == [])

    @invariant()
    def seal8_books_balance(self) -> None:
        for e in (self.p, self.d):
            e.allocator.check_integrity()
            if not e.seqs:
                assert e.allocator.num_free == e.pool.num_pages


TestHandoffs = Handoffs.TestCase
TestHandoffs.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
