"""`kvseal serve` on one host: a worker with work steps on the cores of its idle sibling too, and only while that
sibling has none (kvseal/worker/cores.py). Counted by each worker (`steps_on_lent_cores` in /info): a lone prompt is
prefilled and decoded on lent cores; a prompt prefilled while decode streams another request borrows nothing;
`--no-lend-cores` lends nothing. The tokens are the same either way (the fast arithmetic does not depend on the
thread count: tests/e2e/test_thread_count_invariance.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.helpers.procs import Server, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "2048", "--kv-pool-tokens", "8192"]  # LONG + 300 tokens fit


def _lent(s: Server) -> dict[str, int]:
    return {w["role"]: w["steps_on_lent_cores"] for w in httpx.get(s.url + "/info").json()["workers"]}


def _ask(s: Server, prompt: str, max_tokens: int) -> str:
    r = httpx.post(s.url + "/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


LONG = "The quick brown fox jumps over the lazy dog. " * 120  # about 1,300 tokens: several prefill steps


def test_a_lone_request_steps_on_lent_cores_and_none_are_borrowed_from_a_busy_decoder() -> None:
    s = Server(ARGS).ready(300)
    try:
        assert _lent(s) == {"prefill": 0, "decode": 0}
        alone = _ask(s, LONG, 200)  # decode outlasts LEND_AFTER_S: prefill's core is lent to it then
        lent = _lent(s)
        assert lent["prefill"] >= 1 and lent["decode"] >= 1, lent  # each borrowed the other's idle core
        # decode streams a long request; a prompt prefilled meanwhile steps on prefill's own core only
        streaming, ended, leave = threading.Event(), threading.Event(), threading.Event()

        def stream() -> None:
            with httpx.stream("POST", s.url + "/v1/completions", timeout=300, json={
                    "model": MODEL, "prompt": "Count:", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as r:
                assert r.status_code == 200
                for n, _ in enumerate(r.iter_lines()):
                    if n == 3:
                        streaming.set()
                    if leave.is_set():
                        return  # the client leaves: the request is aborted, no need to decode the rest
            ended.set()

        t = threading.Thread(target=stream)
        t.start()
        try:
            assert streaming.wait(120)
            before = _lent(s)["prefill"]
            again = _ask(s, LONG, 1)
            assert not ended.is_set(), "the stream ended before the prompt was prefilled: lengthen it"
            assert _lent(s)["prefill"] == before  # decode was busy throughout: nothing was lent to prefill
        finally:
            leave.set()
            t.join(300)
        assert alone.startswith(again)  # the first token prefilled on prefill's own core: the same
        assert alone.startswith(_ask(s, LONG, 16))  # the same greedy tokens on lent cores or not
    finally:
        s.stop()


def test_no_lend_cores_keeps_each_worker_on_its_own_threads() -> None:
    s = Server([*ARGS, "--no-lend-cores"]).ready(300)
    try:
        _ask(s, LONG, 16)
        wait_until(lambda: all(w["requests_received"] >= 1 for w in httpx.get(s.url + "/info").json()["workers"]),
                   10, "both workers had the request")
        assert _lent(s) == {"prefill": 0, "decode": 0}
    finally:
        s.stop()
