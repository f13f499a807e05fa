"""What the server is: /health, /info, /v1/models, /version."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvseal import __version__
from kvseal.api.routes.deps import backend_of
from kvseal.tenancy.tenantview import is_admin, tenant_info

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    ok = await backend_of(request).healthy()
    return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)


@router.get("/info")
async def info(request: Request) -> dict[str, Any]:
    """Admin keys (everyone without --api-keys): the whole fleet. A tenant: the model, window, its own figures."""
    backend = backend_of(request)
    if not is_admin(request):
        return tenant_info(request, backend.model_name, backend.context_window)
    return await backend.info()


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    backend = backend_of(request)
    card = {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "kvseal",
            "max_model_len": backend.context_window}
    embedder = getattr(request.app.state, "embedder", None)  # the embedding model beside it (routes/embeddings.py)
    embed = [] if embedder is None else [{"id": embedder.name, "object": "model", "created": 0, "owned_by": "kvseal",
                                          "max_model_len": embedder.pipeline.max_tokens}]
    return {"object": "list", "data": [card, *embed]}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}  # vLLM's shape
