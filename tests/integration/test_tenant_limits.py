"""Per-tenant limits on a real server (one unified process on loopback), through the official openai client.

- alice (rpm=20): past her minute's worth of requests she gets 429 `rate_limit_exceeded` with Retry-After and the
  x-ratelimit-* headers; a client with retries waits as told and succeeds on its second attempt (a client that
  ignored Retry-After and used its own backoff, 0.5 s then 1 s, would be refused again: 20 rpm gives one request
  back every 3 s); bob, without limits, is answered every time meanwhile and never sees a rate header.
- carol (max_concurrent=1): a second request while her first streams gets 429; after it ended, one passes.
- dave (tpm=120): prompt + max_tokens is charged before any worker sees the request: past it, 429 of type tokens;
  a request larger than the limit itself says `x-should-retry: false`, and the client does not retry it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.helpers.procs import Server

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: measures time (scripts/test.sh)
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"alice": "sk-alice-limits-0001", "bob": "sk-bob-limits-0002", "carol": "sk-carol-limits-0003",
        "dave": "sk-dave-limits-0005"}
RPM = 20
TPM = 120  # 2 tokens a second come back: the refused request below would wait about 20 s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"alice {KEYS['alice']} rpm={RPM}\nbob {KEYS['bob']}\ncarol {KEYS['carol']} max_concurrent=1\n"
                    f"dave {KEYS['dave']} tpm={TPM}\nops sk-ops-limits-0004 admin\n")
    s = Server(["--unified", "--max-model-len", "512", "--kv-pool-tokens", "2048", "--api-keys", str(keys)])
    try:
        yield s.ready()
    finally:
        s.stop()


def client(server: Server, tenant: str, retries: int = 0, attempts: list[int] | None = None) -> openai.OpenAI:
    def count(request: httpx.Request) -> None:
        if attempts is not None:
            attempts.append(1)

    http = httpx.Client(event_hooks={"request": [count]}, timeout=120)
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[tenant], max_retries=retries, http_client=http)


def ask(c: openai.OpenAI) -> openai.types.Completion:
    return c.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)


def test_over_rpm_the_client_gets_429_with_headers_and_its_retries_honour_retry_after(server: Server) -> None:
    alice, bob = client(server, "alice"), client(server, "bob")
    for _ in range(RPM):
        ask(alice)
    with pytest.raises(openai.RateLimitError) as e:
        ask(alice)
    err, h = e.value, e.value.response.headers
    assert err.status_code == 429 and err.code == "rate_limit_exceeded" and err.type == "requests"
    assert int(h["retry-after"]) >= 1 and int(h["retry-after-ms"]) > 0
    assert h["x-ratelimit-limit-requests"] == str(RPM) and h["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in h
    # bob is answered every time while alice is refused, and carries no rate headers (he has no limits)
    for _ in range(3):
        r = bob.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)
        assert r.http_response.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers
    attempts: list[int] = []
    ask(client(server, "alice", retries=4, attempts=attempts))
    assert len(attempts) == 2  # refused once, then admitted after waiting what Retry-After said
    ops = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer sk-ops-limits-0004"}).text
    assert 'kvseal:tenant_rate_limited_total{tenant="alice",type="requests"} 2.0' in ops


def test_over_max_concurrent_is_429_until_the_first_request_ends(server: Server) -> None:
    carol = client(server, "carol")
    stream = carol.completions.create(model=MODEL, prompt="Count to fifty:", max_tokens=40, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))  # her first request is in flight
    assert first.choices[0].text is not None
    with pytest.raises(openai.RateLimitError) as e:
        ask(carol)
    assert "concurrent" in e.value.message and e.value.type == "requests"
    for _ in stream:  # it ends ...
        pass
    assert ask(carol).choices[0].finish_reason == "length"  # ... and the next one passes


def test_over_tpm_is_429_tokens_and_a_request_larger_than_the_limit_is_not_retried(server: Server) -> None:
    dave = client(server, "dave")
    r = dave.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=100, temperature=0,
                                                  extra_body={"ignore_eos": True})  # all 100 used: nothing refunded
    assert r.http_response.status_code == 200
    assert r.headers["x-ratelimit-limit-tokens"] == str(TPM) and int(r.headers["x-ratelimit-remaining-tokens"]) < 60
    with pytest.raises(openai.RateLimitError) as e:
        dave.completions.create(model=MODEL, prompt="Hi", max_tokens=60, temperature=0)
    assert e.value.type == "tokens" and "TPM" in e.value.message and int(e.value.response.headers["retry-after"]) >= 1
    attempts: list[int] = []
    with pytest.raises(openai.RateLimitError) as e:
        client(server, "dave", retries=3, attempts=attempts).completions.create(
            model=MODEL, prompt="Hi", max_tokens=TPM + 1, temperature=0)
    assert "too large" in e.value.message and e.value.response.headers["x-should-retry"] == "false"
    assert len(attempts) == 1  # told not to retry: the client did not
