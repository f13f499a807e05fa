"""Three routers over one fleet (one prefill and one decode worker) and one Redis, all real processes on loopback
(issue 34): the tenants' limits and stored responses are the fleet's, whichever router a client reaches.

- a response stored through router 1 is read and continued through routers 2 and 3; another tenant gets 404
  through every router;
- rpm=60 admits at most 60 requests a minute across the three routers together (within one);
- max_concurrent=2 holds across routers;
- kill -9 of a router while it streams: the others keep serving with no error, the killed router's requests are
  aborted on the workers (pages back in the pool), and a client that retries on another router gets its answer;
- Redis restarted under load: limited tenants are refused (503) while it is down, never served unlimited, and
  service comes back by itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.procs import Server, Worker
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration

KEYS = {"acme": "sk-many-acme", "globex": "sk-many-globex", "pair": "sk-many-pair", "free": "sk-many-free"}


class ManyRouters:
    def __init__(self, tmp: Path) -> None:
        self.redis = RedisServer()
        (tmp / "keys").write_text(f"acme {KEYS['acme']} rpm=60\nglobex {KEYS['globex']}\n"
                                  f"pair {KEYS['pair']} max_concurrent=2\nfree {KEYS['free']}\n")
        (tmp / "secret").write_bytes(os.urandom(32).hex().encode())
        self.state = ["--state", self.redis.url, "--state-password-file", str(self.redis.password_file),
                      "--state-secret-file", str(tmp / "secret"), "--state-lease-s", "3",
                      "--api-keys", str(tmp / "keys")]
        self.prefill = Worker("prefill", []).ready()
        self.decode = Worker("decode", []).ready()
        self.routers = [self.router() for _ in range(3)]

    def router(self) -> Server:
        return Server(["--prefill", self.prefill.endpoint, "--decode", self.decode.endpoint, *self.state],
                      command="router").ready()

    def client(self, i: int, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.routers[i].url + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)

    def at_baseline(self) -> bool:
        p, d = self.prefill.info(), self.decode.info()
        return (p["free_pages"] == p["pool_pages"] and d["free_pages"] == d["pool_pages"] and d["reservations"] == 0
                and p["running"] == p["waiting"] == d["running"] == d["waiting"] == 0)

    def stop(self) -> None:
        for proc in (*self.routers, self.prefill, self.decode):
            proc.stop()
        self.redis.close()


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManyRouters]:
    m = ManyRouters(tmp_path_factory.mktemp("many-routers"))
    try:
        yield m
    finally:
        m.stop()


def model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def test_a_response_stored_through_one_router_is_read_and_continued_through_the_others(many: ManyRouters) -> None:
    first = many.client(0, "acme")
    r1 = first.responses.create(model=model(first), input="Remember the number 42.", max_output_tokens=4)
    for i in (1, 2):
        c = many.client(i, "acme")
        assert c.responses.retrieve(r1.id).id == r1.id
        cont = c.responses.create(model=model(c), input="What number?", previous_response_id=r1.id,
                                  max_output_tokens=2)
        assert cont.status in ("completed", "incomplete") and cont.previous_response_id == r1.id
    for i in range(3):
        other = many.client(i, "globex")
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(r1.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model=model(other), input="hi", previous_response_id=r1.id, max_output_tokens=1)


def test_rpm_holds_across_the_three_routers_within_one_request(many: ManyRouters) -> None:
    many.redis.client().delete(*many.redis.client().keys("kvseal:rpm:*") or ["none"])  # a full bucket
    codes, remaining = [], []
    t0 = time.monotonic()
    for i in range(75):  # /tokenize counts against rpm like any request that does work
        r = httpx.post(many.routers[i % 3].url + "/tokenize", json={"prompt": "hi"},
                       headers={"Authorization": f"Bearer {KEYS['acme']}"}, timeout=30)
        codes.append(r.status_code)
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    # each router's headers tell the fleet's bucket: 59, 58, 57, ... whichever router answered (refill aside)
    assert all(0 <= (59 - i) - remaining[i] <= 1 + int(time.monotonic() - t0) for i in range(3)), remaining[:5]
    refilled = int(time.monotonic() - t0)  # the bucket gives one back a second (60/min), on Redis's clock
    # one bucket for the fleet: a minute's worth plus what refilled meanwhile, within one request; three routers
    # each with its own bucket would have admitted all 75
    assert set(codes) <= {200, 429} and 60 <= codes.count(200) <= 60 + refilled + 1, (refilled, codes)


def test_max_concurrent_holds_across_routers(many: ManyRouters) -> None:
    gate = threading.Event()
    held: list[object] = []

    def hold(i: int) -> None:  # a stream kept open, unread past its first chunk, until the gate opens
        c = many.client(i, "pair")
        with c.chat.completions.create(model=model(c), messages=[{"role": "user", "content": "Count to 500."}],
                                       max_tokens=400, stream=True, extra_body={"ignore_eos": True}) as s:
            held.append(next(iter(s)))
            gate.wait(60)

    threads = [threading.Thread(target=hold, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(held) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        third = many.client(2, "pair")
        with pytest.raises(openai.RateLimitError, match="concurrent"):
            third.chat.completions.create(model=model(third), messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1)
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    deadline = time.monotonic() + 30  # the held streams' places come back when their routers see them end
    while True:
        try:
            out = third.chat.completions.create(model=model(third), messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the places of the ended streams never came back"
            time.sleep(0.2)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.serial  # kills a router and replaces it
def test_a_killed_routers_requests_end_on_the_workers_and_the_others_keep_serving(many: ManyRouters,
                                                                                 tmp_path: Path) -> None:
    """And the canary audit (kvseal audit) through a surviving router over the whole run finds no leak."""
    report = tmp_path / "audit.json"
    audit = subprocess.Popen([sys.executable, "-m", "kvseal", "audit", many.routers[0].url, "--api-key", KEYS["free"],
                              "--requests", "16", "--concurrency", "4", "--over-window", "2",
                              "--consistency-prompts", "2", "--max-tokens", "8", "--seed", "11",
                              "--report", str(report), "--timeout", "300"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = many.routers[2]
    c = many.client(2, "free")
    m = model(c)
    started = threading.Barrier(17)

    def stream() -> None:
        try:
            with c.chat.completions.create(model=m, messages=[{"role": "user", "content": "Write a long story."}],
                                           max_tokens=300, stream=True, extra_body={"ignore_eos": True}) as s:
                next(iter(s))
                started.wait(120)
                for _ in s:
                    pass
        except (openai.APIError, httpx.HTTPError, threading.BrokenBarrierError):
            pass  # its router is gone: the client sees the connection drop

    threads = [threading.Thread(target=stream) for _ in range(16)]
    for t in threads:
        t.start()
    started.wait(120)  # all 16 streaming through the victim
    os.killpg(victim.p.pid, signal.SIGKILL)
    victim.p.wait(10)
    others = [many.client(i, "free") for i in (0, 1)]
    for o in others:  # the other routers serve on, with no error
        out = o.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop")
    retried = others[0].chat.completions.create(model=m, messages=[{"role": "user", "content": "Write a long story."}],
                                                max_tokens=8)  # a client that retries elsewhere gets its answer
    assert retried.choices[0].message.content
    many.routers[2] = many.router()  # the next tests find three routers, whatever this one finds below
    for t in threads:
        t.join(30)
    out, _ = audit.communicate(timeout=900)
    assert audit.returncode == 0, out[-3000:]  # every answer its own, every error well formed, no leak
    assert json.loads(report.read_text())["violations"] == [], out[-3000:]
    # the audit's own requests have ended: whatever pages are held now are the victim's, until they are aborted
    deadline = time.monotonic() + 60
    while not many.at_baseline():  # the victim's requests aborted, their pages back (seal 8)
        assert time.monotonic() < deadline, (many.prefill.info(), many.decode.info())
        time.sleep(0.5)


@pytest.mark.serial  # stops and restarts the shared Redis
def test_redis_restarted_under_load_fails_closed_and_recovers_by_itself(many: ManyRouters) -> None:
    acme = {"Authorization": f"Bearer {KEYS['acme']}"}
    url = many.routers[0].url + "/tokenize"
    assert httpx.post(url, json={"prompt": "hi"}, headers=acme, timeout=30).status_code in (200, 429)
    many.redis.stop()
    try:
        down = [httpx.post(many.routers[i % 3].url + "/tokenize", json={"prompt": "hi"}, headers=acme, timeout=30)
                for i in range(6)]
        assert {r.status_code for r in down} == {503}, [r.text for r in down]  # never served unlimited
        assert all(r.json()["error"]["code"] == "state_unavailable" and "retry-after" in r.headers for r in down)
        stored = httpx.get(many.routers[1].url + "/v1/responses/resp_x", headers=acme, timeout=30)
        assert stored.status_code == 503
    finally:
        many.redis.start()
    deadline = time.monotonic() + 30
    while httpx.post(url, json={"prompt": "hi"}, headers=acme, timeout=30).status_code == 503:
        assert time.monotonic() < deadline, "the router did not recover after Redis came back"
        time.sleep(0.2)
