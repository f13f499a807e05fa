"""BodyLimit (tenancy/bodylimit.py) with a fake ASGI connection: a body over the limit gets the 413, and the
middleware reads exactly what the client sends, never waiting for a part that will not come.

Regression: a chunked body whose last part crossed the limit made the middleware wait for more body until
DRAIN_SECONDS (30 s) passed, while the client, done sending, waited for the answer (the fuzz test of 413s spent
5 s an example on it). Here a receive past the end of the body fails the test at once.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.types import Message, Receive, Scope, Send

from kvseal.tenancy.bodylimit import BodyLimit

LIMIT = 1000


async def app_that_reads_the_body(scope: Scope, receive: Receive, send: Send) -> None:
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def run(parts: list[bytes], headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict, int]:
    """(status, JSON body, parts read) for a request sent as `parts`; a read past the last part fails."""
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    read = 0
    sent: list[Message] = []

    async def receive() -> Message:
        nonlocal read
        if read == len(messages):
            pytest.fail("the middleware waited for body past its last part (the client is waiting for the answer)")
        read += 1
        return messages[read - 1]

    async def send(msg: Message) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers or []}
    asyncio.run(BodyLimit(app_that_reads_the_body, LIMIT, 10 * LIMIT, {})(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], json.loads(body) if start["status"] != 200 else {}, read


@pytest.mark.parametrize("parts", [
    [b"x" * (LIMIT + 1)],  # one chunk, over on its only (last) part
    [b"x" * 600, b"x" * 600],  # over on the last part
    [b"x" * 600, b"x" * 600, b"x" * 600],  # over on a middle part: the rest is drained, then 413
])
def test_a_body_over_the_limit_gets_413_after_reading_exactly_what_was_sent(parts: list[bytes]) -> None:
    status, err, read = run(parts)
    assert status == 413 and err["error"]["code"] == "payload_too_large"
    assert read == len(parts)  # all of it read (so the client sees the 413, not a reset), and nothing more


def test_a_declared_length_over_the_limit_is_refused_before_the_app_reads_it() -> None:
    status, err, read = run([b"x" * 700, b"x" * 700], headers=[(b"content-length", b"1400")])
    assert status == 413 and err["error"]["code"] == "payload_too_large" and read == 2


def test_a_body_at_the_limit_reaches_the_app() -> None:
    status, _, read = run([b"x" * 500, b"x" * 500])
    assert status == 200 and read == 2
