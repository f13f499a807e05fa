"""The router's edge, shared by every tenant, partitioned by tenant (seal 11), over HTTP on a fake backend:

- the threads that render and tokenize (tenancy/textpool.py): one tenant filling them holds up no other tenant;
- a prompt that cannot fit the window is refused before it is tokenized (api/text.py);
- /tokenize, /detokenize and stored-response lookups count against rpm and max_concurrent (tenancy/ratelimit.py);
- request bodies in progress have a budget per tenant (tenancy/bodylimit.py);
- stored responses: metadata and tools bounded as OpenAI bounds them, store: false keeps nothing, a conversation
  over the tenant's own budget is refused before any work (api/routes/responses.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest

from kvseal.api.app import build_app
from kvseal.config import ServerConfig, TenantPolicy
from kvseal.tenancy.tenant_file import key_digest
from kvseal.wire.messages import GenerateDelta, GenerateRequest

from .conftest import FakeTokenizer, _FakeBackend, _FakeEncoding

ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}


class GatedTokenizerBackend(_FakeBackend):
    """Tokenizing a text that holds "slow" blocks until the test opens the gate; every call is recorded."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls: list[int] = []  # the length of each text tokenized

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[_FakeEncoding]:
        self.calls.append(len(texts[0]))
        if "slow" in texts[0]:
            assert self.gate.wait(60), "the test never opened the gate"
        return super().encode_batch(texts, add_special_tokens)


class ChatTokenizer(FakeTokenizer):
    chat_template = "fake: the messages' contents, one after another; calls as <tool_call>...</tool_call>"

    def __init__(self) -> None:
        self.backend = GatedTokenizerBackend()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        return "".join(str(m.get("content") or "") for m in messages)


class Backend:
    model_name, context_window = "m", 256

    def __init__(self) -> None:
        self.tokenizer = ChatTokenizer()
        self.seen: list[str] = []

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        self.seen.append(req.tenant)
        yield GenerateDelta(req.request_id, [3], "b", final="length", prompt_tokens=len(req.prompt_ids),
                            completion_tokens=1)

    async def info(self) -> dict[str, Any]:
        return {"role": "test"}

    async def healthy(self) -> bool:
        return True


def app_of(backend: Backend, **cfg: Any) -> Any:
    keys = tuple((key_digest(f"sk-{t}"), t) for t in ("alice", "bob"))
    policies = cfg.pop("policies", {})
    return build_app(backend, ServerConfig(api_keys=keys, tenants=tuple(policies.items()), **cfg))


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvseal", timeout=60)


def test_one_tenant_filling_the_tokenizer_threads_does_not_hold_up_another() -> None:
    """The finding: 6 concurrent huge bodies of one tenant filled asyncio's shared pool (min(32, CPUs + 4) threads)
    and another tenant's 1-token chat waited 37.6 s. Here alice holds 40 tokenizations open at once; bob's
    /tokenize, completion and chat are answered while every one of hers is still waiting."""
    backend = Backend()
    app = app_of(backend)

    async def main() -> None:
        async with client(app) as c:
            hers = [asyncio.create_task(c.post("/tokenize", headers=ALICE, json={"prompt": "slow"}))
                    for _ in range(40)]
            while not backend.tokenizer.backend.calls:  # hers are on the threads
                await asyncio.sleep(0.01)
            pool = app.state.text_pool
            assert pool.running["alice"] <= pool.per_tenant < pool.threads
            mine = await asyncio.wait_for(asyncio.gather(
                c.post("/tokenize", headers=BOB, json={"prompt": "hello"}),
                c.post("/v1/completions", headers=BOB, json={"model": "m", "prompt": "hi", "max_tokens": 1}),
                c.post("/v1/chat/completions", headers=BOB,
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})),
                timeout=10)
            assert [r.status_code for r in mine] == [200, 200, 200]
            assert not any(t.done() for t in hers)  # bob got through while all of alice's work still waited
            assert pool.running["alice"] <= pool.per_tenant
            backend.tokenizer.backend.gate.set()
            assert {(await t).status_code for t in hers} == {200}

    try:
        asyncio.run(main())
    finally:
        backend.tokenizer.backend.gate.set()  # a failing run leaves no thread blocked


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"prompt": "x" * 2000}),
    ("/v1/completions", {"model": "m", "prompt": "x" * 2000, "max_tokens": 1}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]}),
    ("/v1/responses", {"model": "m", "input": "x" * 2000}),
])
def test_a_prompt_that_cannot_fit_the_window_is_refused_before_it_is_tokenized(path: str, body: dict) -> None:
    """2000 bytes, and no token of the fake stands for more than 4: at least 500 tokens, over the 256 window."""
    backend = Backend()

    async def main() -> None:
        async with client(app_of(backend)) as c:
            r = await c.post(path, headers=ALICE, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert "at least 500 tokens" in r.json()["error"]["message"]
            ok = await c.post("/tokenize", headers=ALICE, json={"prompt": "x" * 200})  # under: tokenized in full
            assert ok.status_code == 200 and ok.json()["count"] == 200

    asyncio.run(main())
    assert backend.tokenizer.backend.calls == [200] and backend.seen == []


def test_tokenize_detokenize_and_stored_responses_count_against_rpm() -> None:
    """The finding: none of `limited`'s /tokenize or count_tokens calls was counted."""
    backend = Backend()
    app = app_of(backend, policies={"alice": TenantPolicy(rpm=3)})

    async def main() -> None:
        async with client(app) as c:
            rs = [await c.post("/tokenize", headers=ALICE, json={"prompt": "ab"}),
                  await c.post("/detokenize", headers=ALICE, json={"tokens": [2, 3]}),
                  await c.get("/v1/responses/resp_nothing", headers=ALICE)]
            assert [r.status_code for r in rs] == [200, 200, 404]
            assert [r.headers["x-ratelimit-remaining-requests"] for r in rs] == ["2", "1", "0"]
            over = await c.post("/tokenize", headers=ALICE, json={"prompt": "ab"})
            assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await c.post("/tokenize", headers=BOB, json={"prompt": "ab"})).status_code == 200
            for path in ("/health", "/v1/models", "/info", "/version"):  # what the server is: never counted
                assert (await c.get(path, headers=ALICE)).status_code == 200

    asyncio.run(main())


def test_a_tokenize_in_flight_counts_against_max_concurrent() -> None:
    backend = Backend()
    app = app_of(backend, policies={"alice": TenantPolicy(max_concurrent=1)})

    async def main() -> None:
        async with client(app) as c:
            first = asyncio.create_task(c.post("/tokenize", headers=ALICE, json={"prompt": "slow"}))
            while not backend.tokenizer.backend.calls:
                await asyncio.sleep(0.01)
            second = await c.post("/v1/messages/count_tokens", headers=ALICE,
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert second.status_code == 429 and "concurrent" in second.json()["error"]["message"]
            backend.tokenizer.backend.gate.set()
            assert (await first).status_code == 200

    try:
        asyncio.run(main())
    finally:
        backend.tokenizer.backend.gate.set()


def test_a_tenants_bodies_in_progress_have_a_budget_and_the_other_tenant_keeps_its_own() -> None:
    backend = Backend()
    app = app_of(backend, max_body_bytes=1000, tenant_body_bytes=2500)

    async def main() -> None:
        async with client(app) as c:
            slow = {"prompt": "slow" + "x" * 150}  # 171 bytes of JSON: 14 fit in 2500, the 15th does not
            held = [asyncio.create_task(c.post("/tokenize", headers=ALICE, json=slow)) for _ in range(15)]
            while not backend.tokenizer.backend.calls:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the rest reach the pool's queue, their bodies held
            refused = [t for t in held if t.done()]
            assert len(refused) == 1 and refused[0].result().status_code == 429
            assert "request bodies in progress" in refused[0].result().json()["error"]["message"]
            assert (await c.post("/tokenize", headers=BOB, json=slow | {"prompt": "x" * 150})).status_code == 200
            backend.tokenizer.backend.gate.set()
            codes = [(await t).status_code for t in held]
            assert codes.count(200) == 15 - len(refused) and app.state.body_held == {}

    try:
        asyncio.run(main())
    finally:
        backend.tokenizer.backend.gate.set()


def responses_post(c: httpx.AsyncClient, body: dict[str, Any]) -> Any:
    return c.post("/v1/responses", headers=ALICE, json={"model": "m", "max_output_tokens": 1, **body})


@pytest.mark.parametrize(("extra", "param"), [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"tools": [{"type": "function", "name": f"f{i}"} for i in range(129)]}, "tools"),
])
def test_metadata_and_tools_are_bounded_as_openai_bounds_them(extra: dict, param: str) -> None:
    """The finding: 8 MB of metadata per request, never tokenized so never charged, flushed the shared store."""
    backend = Backend()

    async def main() -> None:
        async with client(app_of(backend)) as c:
            r = await responses_post(c, {"input": "hi", **extra})
            assert r.status_code == 400 and str(r.json()["error"]["param"]).startswith(param), r.text
            ok = await responses_post(c, {"input": "hi", "metadata": {f"k{i}": "v" * 512 for i in range(16)},
                                          "tools": [{"type": "function", "name": f"f{i}"} for i in range(128)],
                                          "tool_choice": "none"})
            assert ok.status_code == 200, ok.text

    asyncio.run(main())
    assert len(backend.seen) == 1


def test_store_false_keeps_nothing_and_a_conversation_over_the_budget_is_refused_first() -> None:
    backend = Backend()
    app = app_of(backend, policies={"alice": TenantPolicy(store_mb=0.004)})  # 4194 bytes

    async def main() -> None:
        async with client(app) as c:
            r = await responses_post(c, {"input": "hi", "store": False})
            assert r.status_code == 200
            assert (await c.get(f"/v1/responses/{r.json()['id']}", headers=ALICE)).status_code == 404
            assert len(app.state.responses.store) == 0
            kept = await responses_post(c, {"input": "hi"})
            assert (await c.get(f"/v1/responses/{kept.json()['id']}", headers=ALICE)).status_code == 200
            metadata = {f"k{i}": "v" * 300 for i in range(16)}  # 4.8 kB echoed with the answer: over the 4.1
            big = await responses_post(c, {"input": "y" * 200, "metadata": metadata})
            assert big.status_code == 400 and big.json()["error"]["param"] == "store", big.text
            assert (await responses_post(c, {"input": "y" * 200, "metadata": metadata,
                                             "store": False})).status_code == 200

    asyncio.run(main())
    assert len(backend.seen) == 3


def test_the_request_log_names_no_prompt_and_no_key(caplog: pytest.LogCaptureFixture) -> None:
    """Logs are the operator's, never a tenant's (nothing tenant-visible): and what they hold of a tenant's request
    is its id, tenant name, status and error code, never its text or its key."""
    backend = Backend()

    async def main() -> None:
        async with client(app_of(backend)) as c:
            r = await c.post("/v1/completions", headers=ALICE,
                             json={"model": "m", "prompt": "canary-7f3a " * 300, "max_tokens": 1})
            assert r.status_code == 400

    with caplog.at_level("INFO", logger="kvseal.requests"):
        asyncio.run(main())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvseal.requests"]
    assert any("tenant=alice" in line and "context_length_exceeded" in line for line in lines), lines
    assert not any("canary-7f3a" in line or "sk-alice" in line for line in lines), lines


def test_a_streamed_response_that_cannot_be_stored_ends_with_an_error_not_completed() -> None:
    """store: true and the store down (Redis unreachable: StateUnavailable): the stream must not say `completed`
    for an answer that a later previous_response_id could not find."""
    from kvseal.errors import StateUnavailable

    backend = Backend()
    app = app_of(backend)

    class DownStore:
        def __init__(self, inner: Any) -> None:
            self.budget_of = inner.budget_of

        async def put(self, *args: Any) -> bool:
            raise StateUnavailable("stored responses cannot be reached")

    app.state.responses = DownStore(app.state.responses)

    async def main() -> str:
        async with client(app) as c:
            r = await c.post("/v1/responses", headers=ALICE,
                             json={"model": "m", "input": "hi", "max_output_tokens": 1, "stream": True})
            return r.text

    text = asyncio.run(main())
    assert "response.completed" not in text and "response.incomplete" not in text, text
    assert '"type": "error"' in text.replace('"type":"error"', '"type": "error"') and "state_unavailable" in text
