"""`kvseal doctor`'s checks on a router's /info (fake dicts here; tests/integration/test_doctor.py runs real fleets):
a good fleet has no problem, and each kind of bad one is named with its fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvseal.doctor import Probe, assess, serving_pairs, table


def worker(role: str, port: int, **kw: Any) -> dict[str, Any]:
    return {"role": role, "endpoint": f"tcp://127.0.0.1:{port}", "state": "serving", "alive": True, "reason": "",
            "pool_tokens": 2048, "model_fingerprint": "sha256:aa", "page_size": 16, "kv_dtype": "float32",
            "kv_layout": "kt:L30", "kernels": "native", "arithmetic": "fast/int8", "tokenizer_digest": "t1",
            "test_faults": "", "free_pages": 128, "cached_pages": 0, "inflight": 0, **kw}


GOOD: dict[str, Any] = {"role": "router", "model": "m", "context_window": 1024, "tokenizer_digest": "t1",
                        "test_faults": "", "live_requests": 0,
                        "workers": [worker("prefill", 1), worker("prefill", 2), worker("decode", 3)]}
TOKENS = (1, 2, 3)


def probes(info: dict[str, Any], tokens: tuple[int, ...] = TOKENS) -> list[Probe]:
    return [Probe(p, d, tokens) for p, d in serving_pairs(info)]


def test_a_good_fleet_has_no_problem_and_every_pair_is_probed() -> None:
    assert serving_pairs(GOOD) == [("tcp://127.0.0.1:1", "tcp://127.0.0.1:3"), ("tcp://127.0.0.1:2", "tcp://127.0.0.1:3")]
    assert assess(GOOD, probes(GOOD)) == []
    text = table("http://r", GOOD)
    assert text.count("serving") == 3 and "2048/1024 ok" in text and "native/fast/int8" in text


def _bad(i: int, **kw: Any) -> dict[str, Any]:
    info = copy.deepcopy(GOOD)
    info["workers"][i].update(kw)
    return info


@pytest.mark.parametrize(("info", "what", "fix"), [
    (_bad(0, state="refused", reason="holds 512 tokens, less than the 1024-token window"), "failed the fleet check",
     "restart it with the settings"),
    (_bad(2, state="lost", alive=False), "decode tcp://127.0.0.1:3 is not reachable", "restart it"),
    (_bad(1, pool_tokens=512), "holds 512 KV tokens, less than the 1024-token", "--kv-pool-tokens 1024"),
    (_bad(1, page_size=32), "disagree on page_size", "fleet's page_size"),
    (_bad(1, model_fingerprint="sha256:bb"), "disagree on model_fingerprint", "fleet's model_fingerprint"),
    (_bad(1, kv_dtype="bfloat16"), "disagree on kv_dtype", "fleet's kv_dtype"),
    (_bad(1, kv_layout="std:L30"), "disagree on kv_layout", "fleet's kv_layout"),
    (_bad(1, arithmetic="exact/native"), "disagree on arithmetic", "fleet's arithmetic"),
    (_bad(2, test_faults="incident"), "test-only faults are on", "without --test-faults"),
    (_bad(2, state="draining"), "is draining", "replacement"),
    (_bad(2, kv_reads_overdue=1, kv_read_pages_overdue=3), "keeps 3 KV page(s) out of its pool for 1 NIXL read(s)",
     "check the KV link"),
    (_bad(0, kv_export_pages_overdue=2), "keeps 2 export window page(s)", "freed at decode's answer"),
])
def test_each_kind_of_bad_fleet_is_named_with_its_fix(info: dict[str, Any], what: str, fix: str) -> None:
    problems = assess(info, probes(info))
    assert any(what in p.what and fix in p.fix for p in problems), problems


def test_a_role_with_no_serving_worker_is_a_problem() -> None:
    info = _bad(2, state="refused", reason="page_size=32")
    assert any("no decode worker is serving" in p.what for p in assess(info, probes(info)))


def test_probes_must_answer_and_agree() -> None:
    ps = probes(GOOD)
    failed = [ps[0], Probe(ps[1].prefill, ps[1].decode, error="502 kv_verification_failed: ...")]
    (p,) = assess(GOOD, failed)
    assert "failed: 502 kv_verification_failed" in p.what and "tcp://127.0.0.1:2" in p.what
    odd = [ps[0], Probe(ps[1].prefill, ps[1].decode, (1, 2, 4))]
    (p,) = assess(GOOD, odd)
    assert "must be equal on every pair" in p.what and "[1, 2, 4]" in p.what and "kvseal drain" in p.fix


def test_a_unified_server_is_one_node_with_no_pairs() -> None:
    info = {**worker("unified", 0), "context_window": 1024, "model": "m"}
    assert serving_pairs(info) == [] and assess(info, [Probe(None, None, TOKENS)]) == []


def test_a_tenant_key_is_told_to_use_an_admin_key(capsys: pytest.CaptureFixture[str]) -> None:
    """With --api-keys, a tenant's /info holds no fleet (tenancy/tenantview.py): the doctor says what key it needs."""
    import argparse
    from unittest import mock

    import httpx

    from kvseal.doctor import run_doctor

    resp = httpx.Response(200, json={"model": "m", "context_window": 256, "tenant": "alice", "requests": {}},
                          request=httpx.Request("GET", "http://x/info"))
    with mock.patch.object(httpx.Client, "get", return_value=resp):
        code = run_doctor(argparse.Namespace(url="http://x", api_key="sk-alice", timeout=5.0, no_probe=True))
    assert code == 2 and "admin key" in capsys.readouterr().err


def test_the_tenant_table_sets_each_tenants_token_share_against_its_weight_share() -> None:
    from kvseal.doctor import tenant_table

    def worker(role: str, tenants: dict[str, dict[str, float]]) -> dict[str, object]:
        return {"role": role, "endpoint": f"tcp://{role}", "state": "serving", "alive": True, "tenants": tenants}

    info = {"role": "router", "workers": [
        worker("prefill", {"a": {"prefill_tokens": 600, "weight": 3, "queue_seconds": 1.0, "scheduled": 10},
                           "b": {"prefill_tokens": 200, "weight": 1, "queue_seconds": 0.5, "scheduled": 5}}),
        worker("decode", {"a": {"decode_tokens": 150, "weight": 3, "kv_pages": 7},
                          "b": {"decode_tokens": 50, "weight": 1}})]}
    text = tenant_table(info)
    assert text is not None
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:]}
    assert rows["a"][1:5] == ["3", "0.750", "750", "0.750"] and rows["a"][5] == "100" and rows["a"][-1] == "7"
    assert rows["b"][1:5] == ["1", "0.250", "250", "0.250"]
    assert tenant_table({"role": "router", "workers": [worker("decode", {})]}) is None  # nothing served yet
