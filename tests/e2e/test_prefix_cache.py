"""Tenants and the prefix cache against real servers (unified and disaggregated), with the official client:
a repeat within a tenant is a hit with the same greedy tokens, another tenant or cache_salt never is (seal 9),
keys are required, and every pool returns to baseline with the cached pages counted free (seal 8)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.procs import Server, wait_until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-test-alice", "bob": "sk-test-bob"}
ADMIN_KEY = "sk-test-ops"  # fleet internals (every worker's pool) are shown to admin keys only
ARGS = ["--max-model-len", "2048", "--kv-pool-tokens", "8192", "--max-num-batched-tokens", "128"]
_n = itertools.count()


def long_prompt() -> str:
    """A prompt no earlier test sent (about 600 tokens: several prefill chunks of 128)."""
    return f"Report {next(_n)}. " + " ".join(f"item {i} costs {i * 7 % 101} coins;" for i in range(80))


@pytest.fixture(scope="module", params=["unified", "disaggregated"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text("".join(f"{t} {k}\n" for t, k in KEYS.items()) + f"ops {ADMIN_KEY} admin\n")
    mode = ["--unified"] if request.param == "unified" else []
    s = Server([*mode, *ARGS, "--api-keys", str(keys)])
    try:
        yield s.ready()
    finally:
        s.stop()


def client(server: Server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=300)


def complete(server: Server, tenant: str, prompt: str, salt: str | None = None) -> tuple[list[int], int]:
    """Greedy token ids and usage.prompt_tokens_details.cached_tokens of one completion."""
    extra: dict[str, Any] = {"return_token_ids": True, "ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    r = client(server, tenant).completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                  extra_body=extra)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]


def pools(server: Server) -> list[dict[str, Any]]:
    info = httpx.get(server.url + "/info", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30).json()
    return info.get("workers", [info])


def at_baseline(server: Server) -> bool:
    return all(w["free_pages"] == w["pool_pages"] and w["running"] == w["waiting"] == 0
               and w["cached_pages_in_use"] == 0 for w in pools(server))


def cached_pages(server: Server) -> int:
    return sum(w["cached_pages"] for w in pools(server))


def test_hits_within_a_tenant_only_and_tokens_are_unchanged(server: Server) -> None:
    prompt = long_prompt()
    before = cached_pages(server)
    ref, cached = complete(server, "alice", prompt)
    assert cached == 0
    one_copy = cached_pages(server) - before
    assert one_copy >= 30  # the prompt's full pages (16 tokens each) are cached
    again, cached = complete(server, "alice", prompt)
    assert again == ref and cached >= one_copy * 16 - 16  # a hit over (almost) all of it, the same tokens
    assert cached_pages(server) - before == one_copy  # served from the cache: nothing new to cache

    theirs, cached = complete(server, "bob", prompt)
    assert theirs == ref and cached == 0  # another tenant: a miss, computed into pages of its own
    assert cached_pages(server) - before == 2 * one_copy  # cached again, apart from alice's copy
    salted, cached = complete(server, "alice", prompt, salt="project-x")
    assert salted == ref and cached == 0  # a cache_salt is a namespace of its own ...
    salted, cached = complete(server, "alice", prompt, salt="project-x")
    assert salted == ref and cached > 0  # ... in which repeats hit
    wait_until(lambda: at_baseline(server), 30, "pools back to baseline")


def test_a_shared_prefix_hits_and_streams_usage(server: Server) -> None:
    head = long_prompt()
    complete(server, "alice", head + " First question: what is the total?")
    chunks = list(client(server, "alice").completions.create(
        model=MODEL, prompt=head + " Second question: which item is cheapest?", max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 512  # the shared head, in whole pages
    assert usage.prompt_tokens_details.cached_tokens % 16 == 0
    wait_until(lambda: at_baseline(server), 30, "pools back to baseline")


def test_keys_are_required_and_never_echoed(server: Server) -> None:
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test-mallory", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.code == "invalid_api_key" and "sk-" not in str(e.value.body)
    for path in ("/info", "/v1/models"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert all(k not in httpx.get(server.url + "/info", timeout=30,
                                  headers={"Authorization": f"Bearer {KEYS['alice']}"}).text for k in KEYS.values())


def probe(url: str, tmp_path: Path) -> tuple[int, str]:
    """`kvseal audit URL --tenant-keys A,B --probes prefix_cache`: exit code and output."""
    keys = f"{KEYS['alice']},{KEYS['bob']}"
    r = subprocess.run([sys.executable, "-m", "kvseal", "audit", url, "--tenant-keys", keys, "--probes", "prefix_cache",
                        "--probe-trials", "3", "--probe-chars", "1500", "--report", str(tmp_path / "probe.json")],
                       check=False, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert all(k not in out for k in KEYS.values()), out  # keys are never printed
    return r.returncode, out


@pytest.mark.serial  # a timing probe: it measures time to first token (scripts/test.sh)
def test_cross_tenant_probe_finds_nothing_shared(server: Server, tmp_path: Path) -> None:
    code, out = probe(server.url, tmp_path)
    assert code == 0 and "ISOLATED" in out and "prefix_cache       held" in out, out


@pytest.mark.serial  # a timing probe: it measures time to first token (scripts/test.sh)
def test_cross_tenant_probe_sees_one_shared_cache_without_keys(tmp_path: Path) -> None:
    s = Server(["--unified", *ARGS])  # no --api-keys: every key is the one tenant, so one cache for all
    try:
        s.ready()
        code, out = probe(s.url, tmp_path)
        assert code == 1 and "SHARED" in out and "prefix_cache       broken" in out, out
    finally:
        s.stop()


def test_no_prefix_cache_turns_it_off(tmp_path: Path) -> None:
    s = Server(["--unified", *ARGS, "--no-prefix-cache"])
    try:
        s.ready()
        code, out = probe(s.url, tmp_path)
        assert code == 0 and "NO CACHE SEEN" in out and "prefix_cache       not_applicable" in out, out
        prompt = long_prompt()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        for _ in range(2):
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        info = httpx.get(s.url + "/info", timeout=30).json()
        assert info["prefix_cache"] is False and info["cached_pages"] == 0
        assert info["free_pages"] == info["pool_pages"]
    finally:
        s.stop()


def test_two_prefill_workers_each_prefix_returns_to_its_worker() -> None:
    s = Server([*ARGS, "--prefill", "2", "--decode", "1"])
    try:
        s.ready()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        heads = [long_prompt() for _ in range(4)]
        hits = []
        for round_ in range(2):
            for h in heads:
                r = c.completions.create(model=MODEL, prompt=f"{h} Question {round_}?", max_tokens=2, temperature=0)
                assert r.usage is not None and r.usage.prompt_tokens_details is not None
                hits.append(r.usage.prompt_tokens_details.cached_tokens)
        assert hits[:4] == [0] * 4 and all(n >= 512 for n in hits[4:]), hits  # random routing: 1 in 16
        info = httpx.get(s.url + "/info", timeout=30).json()
        assert info["routed_by_prefix"] >= 4
        assert sum(w["prefix_cache_hit_tokens"] for w in info["workers"] if w["role"] == "prefill") == sum(hits)
    finally:
        s.stop()
