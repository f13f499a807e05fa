"""OpenAI's /v1/embeddings, served by the embed worker (`kvseal serve --embed-model PATH`; kvseal/embed/).

Text is tokenized here, on the tenant's turn of the text pool, with the embedding model's own tokenizer; every
input over the model's longest input (its sentence-transformers max_seq_length) is a 400 naming it, never cut.
The tokens are charged to the tenant's tpm before the worker sees them, and the call goes to the worker's fair
queue under the tenant's weight. A client that leaves aborts what of its call is still queued. The answer is
OpenAI's: a list of embeddings (floats, or base64 of little-endian float32) and the tokens in usage.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvseal.api.embeddings_protocol import EmbeddingRequest
from kvseal.api.routes.deps import policy_of, tenant_of
from kvseal.embed.client import EmbedClient
from kvseal.embed.metrics import EmbedMetrics
from kvseal.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, RequestAborted
from kvseal.tenancy.limits import Lease
from kvseal.tenancy.state import Limits

router = APIRouter()


def embedder_of(request: Request, model: str) -> EmbedClient:
    """The embed worker's handle when `model` names its model; ModelNotFound otherwise (also when none is served)."""
    embedder: EmbedClient | None = getattr(request.app.state, "embedder", None)  # set by router/api.build_app
    if embedder is None or model != embedder.name:
        shown = model.encode("utf-8", "backslashreplace").decode("utf-8")
        served = (f"This server serves `{embedder.name}` for embeddings." if embedder is not None else
                  "This server serves no embedding model (start kvseal serve with --embed-model PATH).")
        raise ModelNotFound(f"The model `{shown}` does not exist. {served}", param="model")
    return embedder


def tokenize(embedder: EmbedClient, texts: list[str]) -> list[list[int]]:
    """Each text's ids with the model's special tokens; encode_batch releases the GIL while it works."""
    return [list(e.ids) for e in embedder.folder.tokenizer.encode_batch(texts, add_special_tokens=True)]


async def input_ids(request: Request, embedder: EmbedClient, body: EmbeddingRequest) -> list[list[int]]:
    texts = body.texts()
    if texts is None:
        ids = body.token_ids()
        vocab = embedder.vocab_size
        if any(t >= vocab for x in ids for t in x):
            raise InvalidRequest(f"input: a token id is outside the vocabulary [0, {vocab})", param="input")
    else:
        try:
            for t in texts:
                t.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"input: not valid UTF-8 text (a lone surrogate at position {exc.start})",
                                 param="input") from None
        ids = await request.app.state.text_pool.run(tenant_of(request), tokenize, embedder, texts)
    limit = embedder.pipeline.max_tokens
    for i, x in enumerate(ids):
        if len(x) > limit:
            raise ContextLengthExceeded(f"This model's maximum input length is {limit} tokens. However, input {i} "
                                        f"is {len(x)} tokens. Please reduce the length of the input.", param="input")
    return ids


def encoded(rows: np.ndarray, fmt: str) -> list[Any]:
    if fmt == "base64":
        return [base64.b64encode(r.astype("<f4").tobytes()).decode("ascii") for r in rows]
    return rows.astype(np.float64).tolist()  # type: ignore[no-any-return]


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
    started = time.monotonic()
    embedder = embedder_of(request, body.model)
    if body.dimensions is not None and body.dimensions != embedder.dim:
        raise InvalidRequest(f"dimensions: {embedder.name} gives {embedder.dim} dimensions and was not trained to "
                             f"give fewer (no Matryoshka representation); send dimensions {embedder.dim} or leave "
                             f"it out", param="dimensions")
    ids = await input_ids(request, embedder, body)
    tokens = sum(len(x) for x in ids)
    tenant = tenant_of(request)
    lease: Lease | None = getattr(request.state, "rate_lease", None)  # set by tenancy/ratelimit.py
    if lease is not None:  # tpm: before the worker sees the request
        limiter: Limits = request.app.state.limits
        await limiter.charge(lease, tokens, 0)
    call = asyncio.ensure_future(embedder.embed(tenant, policy_of(request).weight, ids))
    while not call.done():  # a client that leaves aborts its call (what is still queued never runs)
        await asyncio.wait({call}, timeout=0.25)
        if not call.done() and await request.is_disconnected():
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            raise RequestAborted("client disconnected")
    rows = call.result()
    metrics: EmbedMetrics | None = getattr(request.app.state, "embed_metrics", None)
    if metrics is not None:
        metrics.observe(tenant, len(ids), tokens, time.monotonic() - started)
    out = {"object": "list", "model": embedder.name,
           "data": [{"object": "embedding", "index": i, "embedding": e}
                    for i, e in enumerate(encoded(rows, body.encoding_format))],
           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    return Response(msgspec.json.encode(out), media_type="application/json")
