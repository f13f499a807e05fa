"""Finding 2 of issue 10, with real processes: no silent holes in an answer, and a router that does not fall
behind while it tokenizes a huge prompt.

* The router reaches its decode worker through a lossy link that drops the second delta of every request (as a
  worker that sent with NOBLOCK and only logged when ZeroMQ refused could). Deltas are numbered per request and
  the router checks continuity: the request ends FAILED with 502 `stream_incomplete` (whole) or an error event
  and no [DONE] (streamed). Before: 200 with text missing.
* A decode worker that says what a healthy one never says (issue 17, section 3): a final delta that is neither stop,
  length nor an error, or an error that carries status 200. The client gets one 502, never a hang or a 200.
* Tokenizing a multi-megabyte chat runs off the router's event loop: /health answers within a second meanwhile.
  Before: the loop was blocked for seconds (and every stream and heartbeat with it).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.helpers.fleet import LoopbackFleet, module_fleet
from tests.helpers.lossy_link import LossyLink
from tests.helpers.procs import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.serial]  # serial: measures time (scripts/test.sh)
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "1024", "--kv-pool-tokens", "2048"]


class Fleet(LoopbackFleet):
    def __init__(self) -> None:
        super().__init__(ARGS)

    def decode_endpoint(self) -> str:
        self.link = LossyLink(self.decode.endpoint)
        return self.link.endpoint

    def stop(self) -> None:
        super().stop()
        self.link.close()


fleet = module_fleet(Fleet)


BODY = {"model": MODEL, "prompt": "Count from one to twenty:", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def test_a_lost_delta_fails_the_request_instead_of_a_200_with_text_missing(fleet: Fleet) -> None:
    r = httpx.post(fleet.router.url + "/v1/completions", json=BODY, timeout=120)
    assert len(fleet.link.dropped) == 1  # the link did drop one delta of this request
    assert r.status_code == 502, r.text  # never 200
    err = r.json()["error"]
    assert err["code"] == "stream_incomplete" and "hole" in err["message"], err
    assert r.headers["x-request-id"]
    def logged() -> list[str]:  # written once the response is out
        return [line for line in fleet.router.output().splitlines() if r.headers["x-request-id"] in line]

    wait_until(logged, 10, "the failed request logged")
    time.sleep(0.5)
    lines = logged()
    assert len(lines) == 1 and "status=502" in lines[0] and "stream_incomplete" in lines[0], lines
    assert "stage=decoding" in lines[0] and "decode worker" in lines[0], lines
    wait_until(fleet.at_baseline, 30, "pools back to baseline")  # decode was told: the request ended there


def test_a_lost_delta_ends_a_stream_with_an_error_event_and_no_done(fleet: Fleet) -> None:
    events: list[str] = []
    with httpx.stream("POST", fleet.router.url + "/v1/completions", json={**BODY, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200  # the first delta arrived whole: the stream had started
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert len(fleet.link.dropped) == 2
    assert "[DONE]" not in events, events
    assert json.loads(events[-1])["error"]["code"] == "stream_incomplete", events
    wait_until(fleet.at_baseline, 30, "pools back to baseline")


def test_tokenizing_a_huge_prompt_does_not_stall_the_router(fleet: Fleet) -> None:
    huge = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog. " * 130_000}]}
    data = json.dumps(huge).encode()
    assert 5_000_000 < len(data) < 8 * 2**20  # under the body limit: it is parsed and tokenized
    done: list[httpx.Response] = []
    t = threading.Thread(target=lambda: done.append(httpx.post(
        fleet.router.url + "/v1/chat/completions", content=data, timeout=300,
        headers={"content-type": "application/json"})))
    t.start()
    time.sleep(0.5)  # the body is in; tokenizing starts
    worst = 0.0
    while t.is_alive():
        started = time.monotonic()
        assert httpx.get(fleet.router.url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - started)
        time.sleep(0.05)
    t.join()
    assert done[0].status_code == 400 and done[0].json()["error"]["code"] == "context_length_exceeded"
    assert worst < 1.0, f"/health took {worst:.2f}s while the router tokenized"


@contextmanager
def tampered(fleet: Fleet, rule: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Iterator[None]:
    fleet.link.tamper = rule
    try:
        yield
    finally:
        fleet.link.tamper = None


def failed_lines(fleet: Fleet, r: httpx.Response) -> list[str]:
    def logged() -> list[str]:
        return [line for line in fleet.router.output().splitlines() if r.headers["x-request-id"] in line]

    wait_until(logged, 10, "the failed request logged")
    time.sleep(0.3)
    return logged()


def test_a_decode_final_that_is_no_outcome_ends_every_sample_with_one_error(fleet: Fleet) -> None:
    """Before: the router's FinishReason("weird") raised ValueError; fanout caught only KvsealError, so the client
    of an n=2 request waited forever, and the request was logged ABORTED "client disconnected"."""
    def weird(msg: dict[str, Any]) -> dict[str, Any]:
        d = msg.get("delta") if msg.get("kind") == "delta" else None
        if d is not None and d.get("final") in ("stop", "length"):
            d["final"] = "weird"
        return msg

    with tampered(fleet, weird):
        try:
            r = httpx.post(fleet.router.url + "/v1/completions", json={**BODY, "max_tokens": 3, "n": 2}, timeout=30)
        except httpx.ReadTimeout:
            raise AssertionError("the client got no answer within 30 s") from None
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "worker_failed" and "'weird'" in err["message"], err
    lines = failed_lines(fleet, r)
    assert len(lines) == 1 and "status=502" in lines[0] and "stage=decoding" in lines[0], lines
    wait_until(fleet.at_baseline, 30, "pools back to baseline")


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_error_that_carries_status_200_reaches_the_client_as_a_502(fleet: Fleet, stream: bool) -> None:
    """Before: the router kept a peer error's status whatever it was: HTTP 200 with an error body."""
    def error_200(msg: dict[str, Any]) -> dict[str, Any]:
        d = msg.get("delta") if msg.get("kind") == "delta" else None
        if d is not None and d.get("final") is None:
            msg["delta"] = {**d, "token_ids": [], "text": "", "final": "failed", "stage": "decoding",
                            "error": {"kind": "WorkerFailed", "message": "decode says no", "status": 200,
                                      "type": "server_error", "code": "worker_failed", "param": None}}
        return msg

    with tampered(fleet, error_200):
        r = httpx.post(fleet.router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=60)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "worker_failed" and r.json()["error"]["message"] == "decode says no"
    lines = failed_lines(fleet, r)
    assert len(lines) == 1 and "status=502" in lines[0], lines
    wait_until(fleet.at_baseline, 30, "pools back to baseline")  # decode was told the request ended
