"""Finding 3 of issue 10 on the real engines (tiny model): what a peer sends cannot end a decode engine or fail
requests that share its batch.

* After fail_all the reservation tables are empty: a KV arrival for a request that ended there is refused
  (before: IllegalTransition outside any handler, and the decode process exited).
* The first token and its logprobs are covered by a checksum and range-checked against the model and the
  request: an id of 10**6 is refused at verification (before: emitted to the client, then the next step crashed
  and failed every request in the batch).
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvseal.errors import InternalError, TransferVerificationFailed
from kvseal.transfer.manifest import KVManifest, PagePayload, build_manifest
from kvseal.wire.messages import GenerateDelta, GenerateRequest, SamplingParams
from kvseal.wire.reservation import Reservation
from tests.helpers.halves import DecodeHalf, PrefillHalf, decode_engine, prefill_engine

from .conftest import tiny_checkpoint

CK = tiny_checkpoint()


def _cfg() -> EngineConfig:
    return EngineConfig(model=ModelConfig(max_model_len=128), cache=CacheConfig(page_size=4, pool_tokens=256),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32))


def _handoff(p: PrefillHalf, d: DecodeHalf, rid: str, n: int = 9,
             logprobs: int | None = None) -> tuple[KVManifest, PagePayload, Reservation]:
    ids = torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(len(rid))).tolist()
    req = GenerateRequest(rid, ids, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   logprobs=logprobs))
    res = d.kv.reserve(req, timeout_s=60.0, kv_endpoint="tcp://test")
    p.add_request(req)
    while not (ready := p.kv.take_ready()):
        p.step()
    (h,) = ready
    manifest, payload = p.kv.package(h, res)
    return manifest, payload, res


def _rebuilt(m: KVManifest, res: Reservation, payload: PagePayload, first_token: int,
             first_logprob: float | None = None, first_top: tuple[tuple[int, float], ...] = ()) -> KVManifest:
    """A well-formed manifest (every checksum matches) that claims another first token or logprobs."""
    return build_manifest(res, payload, num_tokens=m.num_tokens, first_token=first_token,
                          kv=m.kv, first_logprob=first_logprob, first_top=first_top)


def _run(d: DecodeHalf) -> dict[str, list[GenerateDelta]]:
    out: dict[str, list[GenerateDelta]] = {}
    while d.has_work():
        for delta in d.step():
            out.setdefault(delta.request_id, []).append(delta)
    return out


def _at_baseline(d: DecodeHalf) -> bool:
    d.allocator.check_integrity()
    return d.allocator.num_free == d.pool.num_pages and not d.seqs and not d.kv.reserved and not d.kv.reservations


def test_a_late_arrival_after_fail_all_is_refused_and_changes_nothing() -> None:
    p, d = prefill_engine(_cfg(), CK), decode_engine(_cfg(), CK)
    manifest, payload, _ = _handoff(p, d, "late")
    finals = d.fail_all(InternalError("the engine failed while running this request"))
    assert [f.final for f in finals] == ["failed"]
    with pytest.raises(TransferVerificationFailed, match="holds no reservation"):
        d.kv.accept(manifest, payload)
    assert not d.kv.reserved and not d.kv.reservations  # no book names the ended request any more
    assert _at_baseline(d)


def test_a_duplicate_arrival_is_refused_and_the_first_one_stands() -> None:
    p, d = prefill_engine(_cfg(), CK), decode_engine(_cfg(), CK)
    manifest, payload, _ = _handoff(p, d, "twice")
    d.kv.accept(manifest, payload)
    with pytest.raises(TransferVerificationFailed, match="holds no reservation"):
        d.kv.accept(manifest, payload)
    out = _run(d)
    assert out["twice"][-1].final == "length"
    assert _at_baseline(d)


@pytest.mark.parametrize("change", ["out_of_vocab", "negative", "changed_in_flight", "logprobs_not_asked"])
def test_a_bad_first_token_is_refused_and_the_batch_runs_on(change: str) -> None:
    p, d = prefill_engine(_cfg(), CK), decode_engine(_cfg(), CK)
    good_m, good_p, _ = _handoff(p, d, "innocent")
    bad_m, bad_p, bad_res = _handoff(p, d, "hostile")
    d.kv.accept(good_m, good_p)
    d.step()  # the innocent request is decoding when the hostile arrival comes
    match change:
        case "out_of_vocab" | "negative":
            # a well-formed manifest: its checksums match the bad token, only the range check can catch it
            bad_m = _rebuilt(bad_m, bad_res, bad_p, 10**6 if change == "out_of_vocab" else -1)
        case "changed_in_flight":
            bad_m = msgspec.structs.replace(bad_m, first_token=(bad_m.first_token + 1) % 64)
        case "logprobs_not_asked":
            bad_m = _rebuilt(bad_m, bad_res, bad_p, bad_m.first_token, -0.1, ((3, -0.5),))
    with pytest.raises(TransferVerificationFailed, match="first_token|first_checksum|first_logprob"):
        d.kv.accept(bad_m, bad_p)
    out = _run(d)
    assert out["hostile"][-1].final == "failed" and not any(x.token_ids for x in out["hostile"])
    assert out["innocent"][-1].final == "length" and out["innocent"][-1].completion_tokens == 6
    assert _at_baseline(d)


def test_first_token_logprobs_are_checked_against_what_the_request_asked() -> None:
    p, d = prefill_engine(_cfg(), CK), decode_engine(_cfg(), CK)
    m, pay, res = _handoff(p, d, "lp", logprobs=2)
    assert m.first_logprob is not None and len(m.first_top) == 2
    bad = _rebuilt(m, res, pay, m.first_token, m.first_logprob, ((m.first_top[0][0], float("nan")), m.first_top[1]))
    with pytest.raises(TransferVerificationFailed, match="first_top"):
        d.kv.accept(bad, pay)
    m2, pay2, _ = _handoff(p, d, "lp2", logprobs=2)
    d.kv.accept(m2, pay2)  # the real thing passes
    assert _run(d)["lp2"][-1].final == "length"
