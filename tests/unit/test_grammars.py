"""response_format grammars compile off the engine's loop: the compiler pool (time and size limits, kills and
restarts), the per-tenant cache (seal 9), and the engine stepping other requests while one waits for its grammar.

Real compiler processes and xgrammar, over a 64-token vocabulary of single characters (the tiny model's width).
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest

from kvseal.config import GrammarConfig
from kvseal.engine.engine import Engine
from kvseal.engine.grammar_compiler import CompilerInit
from kvseal.engine.sampling import LOGPROB_FLOOR
from kvseal.engine.structured import Grammars
from kvseal.errors import InvalidRequest, KvsealError
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams, response_format

from .conftest import make_engine

# token id -> text: 0 unknown, 1 the stop token, then one character each
VOCAB = ["<unk>", "</s>", *'{}[]":,-.0123456789 abcdefghijklmnopqrstuvwxyz'][:64]
VOCAB += [f"<x{i}>" for i in range(64 - len(VOCAB))]
SLOW = response_format("json_schema", {"type": "string", "pattern": "[0-9]{8000}"})  # seconds to compile
SMALL = response_format("json_schema", {"type": "integer", "minimum": 0, "maximum": 99})


class TinyGrammars(Grammars):
    """Grammars over VOCAB (the fake tokenizer has no vocabulary file for xgrammar to read)."""

    def compiler_init(self) -> CompilerInit:
        return CompilerInit(VOCAB, 0, [1], False)  # RAW: each token is its own text


def grammars(**cfg: object) -> TinyGrammars:
    return TinyGrammars(None, 64, GrammarConfig(**cfg))  # type: ignore[arg-type]


def settle(g: Grammars) -> None:
    while g.busy:
        g.poll(0.05)


def dead(pid: int, within_s: float = 10.0) -> bool:
    """Gone, or a zombie waiting to be reaped (the pool reaps killed processes on later polls, never waiting),
    within a while: SIGKILL takes effect asynchronously."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.01)
    return False


def test_a_format_compiles_in_a_process_and_is_cached_per_tenant() -> None:
    g = grammars(grammar_compilers=1)
    try:
        assert g.compiled("alice", SMALL) is None and g.busy  # compiling elsewhere; the caller goes on
        settle(g)
        alices = g.compiled("alice", SMALL)
        assert alices is not None and not isinstance(alices, KvsealError)
        m = g.matcher(alices)
        assert m.accept_string("42") and not m.accept_string("7")  # at most 99
        assert g.pool is not None and g.pool.pids and all(p != os.getpid() for p in g.pool.pids)
        # bob's identical format is not served from alice's entry: his own compile, his own grammar (seal 9)
        assert g.compiled("bob", SMALL) is None and g.busy
        settle(g)
        bobs = g.compiled("bob", SMALL)
        assert bobs is not None and bobs is not alices
        assert g.compiled("alice", SMALL) is alices and not g.busy  # her own entry: no compile
    finally:
        g.close()


def test_a_compile_past_the_timeout_kills_its_process_and_is_a_400_then_a_fresh_one_compiles() -> None:
    g = grammars(grammar_compilers=1, grammar_timeout_s=0.5)
    try:
        assert g.compiled("bob", SLOW) is None
        while g.pool is not None and not any(c.job for c in g.pool._children):
            g.poll(0.05)  # started, and compiling
        assert g.pool is not None
        pid = g.pool.pids[0]
        settle(g)
        err = g.compiled("bob", SLOW)
        assert isinstance(err, InvalidRequest) and err.status == 400 and err.param == "response_format"
        assert "took longer than 0.5s" in err.message
        assert g.pool.killed == 1 and dead(pid) and g.pool.pids == []
        assert g.compiled("bob", SLOW) is err and not g.busy  # the same again fails at once, for bob
        assert g.compiled("alice", SMALL) is None
        settle(g)
        assert not isinstance(g.compiled("alice", SMALL), KvsealError) and g.pool.pids[0] != pid
    finally:
        g.close()


def test_a_schema_over_the_size_limit_is_a_400_before_anything_compiles() -> None:
    g = grammars(grammar_max_bytes=100)
    big = response_format("json_schema", {"type": "object", "description": "x" * 200})
    with pytest.raises(InvalidRequest) as e:
        g.compiled("alice", big)
    assert e.value.param == "response_format" and "at most 100 bytes" in e.value.message
    assert g.pool is None  # no compiler was even started


def test_a_schema_xgrammar_refuses_is_a_400_naming_the_schema() -> None:
    g = grammars(grammar_compilers=1)
    try:
        bad = response_format("json_schema", {"type": "integer", "minimum": 5, "maximum": 1})
        g.compiled("alice", bad)
        settle(g)
        err = g.compiled("alice", bad)
        assert isinstance(err, InvalidRequest) and err.param == "response_format.json_schema.schema"
    finally:
        g.close()


def _drain(e: Engine, order: list[str]) -> dict[str, list[GenerateDelta]]:
    out: dict[str, list[GenerateDelta]] = {}
    while e.has_work():
        for d in e.step():
            out.setdefault(d.request_id, []).append(d)
            order.append(d.request_id)
    return out


def test_the_batch_steps_while_a_request_waits_for_its_grammar(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    e.grammars = TinyGrammars(e.tokenizer, 64, GrammarConfig(grammar_compilers=2, grammar_timeout_s=1.0))
    try:
        free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        e.add_request(GenerateRequest("slow", [3, 4, 5], SamplingParams(max_tokens=8, response_format=SLOW),
                                      tenant="bob"))
        e.add_request(GenerateRequest("int", [3, 4, 5], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                                                       response_format=SMALL), tenant="alice"))
        e.add_request(GenerateRequest("free", [6, 7, 8], free, tenant="alice"))
        assert {s.request_id for s in e.compiling()} == {"slow", "int"}  # admitted, holding no pages, outside the batch
        order: list[str] = []
        out = _drain(e, order)
        for rid, ds in out.items():  # seal 1: one outcome each, last
            assert [d.final is not None for d in ds].count(True) == 1 and ds[-1].final is not None, rid
        # every token of the free request came before anything of the two that waited for their grammars
        last_free = max(i for i, rid in enumerate(order) if rid == "free")
        assert order.index("int") > last_free and order.index("slow") > last_free
        assert out["free"][-1].final == "length"
        slow = out["slow"][-1]
        assert slow.final == "rejected" and slow.error is not None and slow.error.status == 400
        assert slow.error.param == "response_format" and slow.token_ids == []
        ints = [t for d in out["int"] for t in d.token_ids]
        assert out["int"][-1].final == "stop" and 0 <= json.loads("".join(VOCAB[t] for t in ints[:-1])) <= 99
        # logprobs of the model's own distribution: finite, and the top alternatives are not only what the
        # grammar allowed (digits, the stop), nor pinned at the floor where a mask would have put them
        lps = [lp for d in out["int"] for lp in d.logprobs or []]
        assert len(lps) == len(ints) and all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in lps)
        assert all(math.isfinite(v) for lp in lps for _, v in lp.top)
        allowed = {1, *(VOCAB.index(c) for c in "0123456789")}
        assert any(t not in allowed and v > LOGPROB_FLOOR for lp in lps for t, v in lp.top)
        assert e.grammars.pool is not None and e.grammars.pool.killed == 1
        assert e.info()["grammar_compiles_killed"] == 1 and e.info()["waiting_for_grammar"] == 0
        assert e.allocator.num_free == e.pool.num_pages and not e.compiling()  # seal 8
    finally:
        e.grammars.close()


def test_a_request_aborted_while_compiling_ends_once(tiny: Checkpoint) -> None:
    e = make_engine(tiny)
    e.grammars = TinyGrammars(e.tokenizer, 64, GrammarConfig(grammar_compilers=1, grammar_timeout_s=0.5))
    try:
        e.add_request(GenerateRequest("slow", [3, 4, 5], SamplingParams(max_tokens=8, response_format=SLOW)))
        e.step()
        e.abort("slow")
        out = _drain(e, [])
        assert [d.final for d in out["slow"]] == ["aborted"] and not e.compiling() and not e.seqs
        assert e.allocator.num_free == e.pool.num_pages
    finally:
        e.grammars.close()


def test_logprobs_are_floored_never_minus_infinity() -> None:
    import torch

    from kvseal.engine.sampling import sample

    logits = torch.tensor([[0.0, float("-inf"), 1.0, -1e30]])
    _, lps = sample(logits, [SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)], [0], [0])
    lp = lps[0]
    assert lp is not None and lp.token_id == 2
    assert all(math.isfinite(v) and v >= LOGPROB_FLOOR for _, v in lp.top) and len(lp.top) == 3


def test_decode_holds_verified_kv_until_its_grammar_arrives_then_decodes(tiny: Checkpoint) -> None:
    from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvseal.lifecycle import State
    from tests.helpers.halves import decode_engine, prefill_engine

    cfg = EngineConfig(model=ModelConfig(max_model_len=128), cache=CacheConfig(page_size=4, pool_tokens=256),
                       scheduler=SchedulerConfig(max_num_batched_tokens=32))
    p, d = prefill_engine(cfg, tiny), decode_engine(cfg, tiny)
    p.grammars = TinyGrammars(p.tokenizer, 64, GrammarConfig(grammar_compilers=1))
    d.grammars = TinyGrammars(d.tokenizer, 64, GrammarConfig(grammar_compilers=1))
    try:
        req = GenerateRequest("r", [3, 4, 5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                                                                   response_format=SMALL), tenant="alice")
        res = d.kv.reserve(req, timeout_s=60.0, kv_endpoint="tcp://test")  # decode's compile starts here
        p.add_request(req)
        while not (ready := p.kv.take_ready()):
            p.step()
        manifest, payload = p.kv.package(ready[0], res)
        assert manifest.first_logprob is not None and all(math.isfinite(v) for _, v in manifest.first_top)
        d.kv.accept(manifest, payload)  # verified (finite unmasked logprobs pass seal 4); decode's grammar not yet in
        p.kv.end_handoff("r", None)
        (seq,) = d.compiling()
        assert seq.life.state is State.VERIFIED and d.allocator.num_owned > 0 and seq not in d.scheduler.waiting
        out = _drain(d, [])["r"]
        ints = [t for x in out for t in x.token_ids]
        assert out[-1].final == "stop" and ints[0] == manifest.first_token
        assert 0 <= json.loads("".join(VOCAB[t] for t in ints[:-1])) <= 99
        assert d.allocator.num_free == d.pool.num_pages and p.allocator.num_free == p.pool.num_pages
    finally:
        p.grammars.close()
        d.grammars.close()


def test_tenants_take_turns_for_a_compiler() -> None:
    g = grammars(grammar_compilers=1, grammar_timeout_s=0.5)
    slow2 = response_format("json_schema", {"type": "string", "pattern": "[0-9]{8001}"})
    try:
        g.compiled("bob", SLOW)
        g.compiled("bob", slow2)
        g.compiled("alice", SMALL)  # after both of bob's: served after his first, before his second
        while g.compiled("alice", SMALL) is None:
            g.poll(0.05)
        assert isinstance(g.compiled("bob", SLOW), InvalidRequest) and g.compiled("bob", slow2) is None
        settle(g)
        assert isinstance(g.compiled("bob", slow2), InvalidRequest)
    finally:
        g.close()
