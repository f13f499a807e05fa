"""`POST /doctor/probe`: one greedy request through a chosen (prefill, decode) pair, for `kvseal doctor`.

The answer is the pair's output token ids (or its OpenAI-shaped error with the status), so the doctor can check that
every pair of the fleet gives the same greedy tokens. Without `prefill` and `decode` the backend pairs as usual
(a unified server has no pairs). With --api-keys, admin keys only (it names workers); probes are not in /metrics.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvseal.api.text import encode
from kvseal.errors import InvalidRequest, KvsealError
from kvseal.router.backend import Backend
from kvseal.tenancy.tenantview import require_admin
from kvseal.wire.messages import GenerateRequest, SamplingParams

PROBE_PROMPT = "The capital of France is"
PROBE_TOKENS = 8


def install_probe(app: FastAPI, backend: Backend) -> None:
    @app.post("/doctor/probe", include_in_schema=False)
    async def probe(request: Request, prefill: str | None = None, decode: str | None = None) -> Any:
        require_admin(request, "/doctor/probe")
        if (prefill is None) != (decode is None):
            raise InvalidRequest("give both prefill and decode endpoints, or neither", param="prefill")
        ids = encode(backend.tokenizer, PROBE_PROMPT, add_special_tokens=True)  # five words: no thread needed
        req = GenerateRequest(f"probe-{uuid.uuid4().hex}", ids,
                              SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True),
                              tenant=str(getattr(request.state, "tenant", "")))
        pinned = (prefill, decode) if prefill is not None and decode is not None else None
        if pinned and not hasattr(backend, "prefills"):
            raise InvalidRequest("this server runs one unified engine: it has no (prefill, decode) pairs",
                                 param="prefill")
        gen = backend.generate(req, pin=pinned) if pinned else backend.generate(req)  # type: ignore[call-arg]
        t0, tokens = time.monotonic(), []
        try:
            async for d in gen:
                if d.error is not None:
                    err = KvsealError.from_info(d.error)
                    return JSONResponse(err.to_openai(), status_code=err.status)
                tokens += d.token_ids
        finally:
            await gen.aclose()
        return {"prefill": prefill, "decode": decode, "tokens": tokens, "seconds": time.monotonic() - t0}
