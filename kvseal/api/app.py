"""The OpenAI HTTP API over any Backend: the app, its middleware and its routes, one module per concern.

- routes/status.py: /health, /info, /v1/models, /version
- routes/generate.py: /v1/chat/completions, /v1/completions (request -> GenerateRequest)
- routes/tokens.py: /tokenize, /detokenize
- routes/responses.py: OpenAI's /v1/responses (stored responses per tenant: response_store.py)
- routes/embeddings.py: /v1/embeddings, served by the embed worker when there is one (kvseal/embed/)
- routes/messages.py: Anthropic's /v1/messages and /v1/messages/count_tokens (errors in Anthropic's shape:
  anthropic_errors.py)
- respond.py: deltas -> a whole response or a stream (never a 200 for a request that did not complete)
- http_errors.py: every failure as OpenAI-shaped JSON with its status
- ratelimit.py, limits.py: each tenant's max_concurrent, rpm and tpm (429 with Retry-After and x-ratelimit-*)

Every response carries X-Request-Id, and every request that did not complete is logged once
(tenancy/requestlog.py). Prompts are rendered and tokenized off the event loop (api/text.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvseal import __version__
from kvseal.api.anthropic_errors import AnthropicErrors
from kvseal.api.http_errors import install_error_handlers
from kvseal.api.routes import embeddings, generate, messages, responses, status, tokens
from kvseal.config import ServerConfig
from kvseal.embed.client import EmbedClient
from kvseal.router.backend import Backend
from kvseal.tenancy.bodylimit import BodyLimit
from kvseal.tenancy.ratelimit import RateLimits
from kvseal.tenancy.requestlog import RequestLog
from kvseal.tenancy.state import build_state
from kvseal.tenancy.tenants import TenantAuth
from kvseal.tenancy.tenantview import TenantFigures, new_figures
from kvseal.tenancy.textpool import TextPool


def build_app(backend: Backend, cfg: ServerConfig, embedder: EmbedClient | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        if embedder is not None:
            await embedder.start()
        try:
            yield
        finally:
            app.state.text_pool.shutdown()
            if embedder is not None:
                await embedder.stop()
            closed = state.close()
            if closed is not None:
                await closed
            await backend.stop()

    app = FastAPI(title="kvseal", version=__version__, lifespan=lifespan)
    app.state.backend = backend  # the routes read it through routes/deps.py
    app.state.embedder = embedder  # routes/embeddings.py: None without --embed-model
    app.state.text_pool = TextPool(cfg.text_pool_threads, cfg.text_threads_each)  # api/text.py
    backend.tokenizer.longest_token_bytes  # noqa: B018 (measured once here, not on a request's time)
    app.state.body_held = {}  # tenant -> bytes of its bodies in requests in progress
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes, tenant_bytes=cfg.tenant_body_bytes,
                       held=app.state.body_held)
    app.state.tenant_figures = new_figures()  # each tenant's own requests, for its /info (tenancy/tenantview.py)
    app.add_middleware(TenantFigures, figures=app.state.tenant_figures)  # inside TenantAuth: knows the tenant
    app.state.tenant_policies = dict(cfg.tenants)  # weight and class for each request (routes/generate.py)
    state = build_state(cfg, app.state.tenant_policies)  # memory, or Redis shared by every router (issue 34)
    app.state.limits, app.state.responses = state.limits, state.responses
    logging.getLogger("kvseal").info("tenant state (limits, stored responses): %s", state.where)
    app.add_middleware(RateLimits, limiter=app.state.limits)  # inside TenantAuth, before any body is read
    app.add_middleware(TenantAuth, api_keys=cfg.api_keys, admin_keys=cfg.admin_keys)  # runs before any body is read
    app.add_middleware(AnthropicErrors)  # outside every part that may write an error: one shape per route
    app.add_middleware(RequestLog)  # added last: outermost, it sees every response
    install_error_handlers(app)
    for module in (status, generate, tokens, messages, responses, embeddings):
        app.include_router(module.router)
    return app
