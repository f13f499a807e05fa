"""What a route reads from its request: the app's backend, the caller's tenant and its settings."""

from __future__ import annotations

from fastapi import Request

from kvseal.api.text import PromptText
from kvseal.config import TenantPolicy
from kvseal.errors import ModelNotFound
from kvseal.router.backend import Backend


def backend_of(request: Request) -> Backend:
    backend: Backend = request.app.state.backend  # set by api/app.build_app
    return backend


def tenant_of(request: Request) -> str:
    return str(request.state.tenant)  # set by TenantAuth: "" when the server has no --api-keys


def policy_of(request: Request) -> TenantPolicy:
    """The caller's settings from the tenants file (defaults for a tenant without any): never from the body."""
    policies: dict[str, TenantPolicy] = getattr(request.app.state, "tenant_policies", {})
    return policies.get(tenant_of(request), DEFAULT_POLICY)


DEFAULT_POLICY = TenantPolicy()


def prompt_text(request: Request) -> PromptText:
    """The caller's way to render and tokenize: its tenant's turn on the app's text pool (tenancy/textpool.py)."""
    backend = backend_of(request)
    return PromptText(backend.tokenizer, request.app.state.text_pool, tenant_of(request), backend.context_window)


def check_model(backend: Backend, name: str | None) -> None:
    """A request naming a model must name the served one (an absent model means the served one)."""
    if name is not None and name != backend.model_name:
        shown = name.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates stay printable
        raise ModelNotFound(f"The model `{shown}` does not exist. This server serves `{backend.model_name}`.",
                            param="model")
