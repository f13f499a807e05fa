"""The HTTP front that `kvseal serve` and `kvseal router` both run: its flags (ServerConfig's fields, the tenants
file, the chat template, the process's), the configs read back from them, and the app they serve."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvseal import config_args
from kvseal.config import ServerConfig
from kvseal.config_args import add_config_args
from kvseal.config_fleet import ProcessConfig

if TYPE_CHECKING:
    from kvseal.embed.client import EmbedClient
    from kvseal.engine.engine import Engine


def add_server_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, ServerConfig)
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="require a bearer key on every route but /health: FILE has one `TENANT KEY` line per key "
                        "(# comments), optionally followed by the tenant's settings: weight=W priority_class=N "
                        "max_concurrent=N rpm=N tpm=N kv_share=F store_mb=M (docs/tenants.md); the tenant keys the "
                        "prefix cache. `TENANT KEY admin` marks an admin key: only "
                        "those see the fleet's internals (/info's workers, /metrics, /doctor/probe); a tenant's "
                        "/info shows the model, the window and its own requests. Without it: no keys, one tenant, "
                        "everyone sees everything")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="render chats with the jinja2 template in FILE instead of the model's own (as vLLM's "
                        "--chat-template; /tokenize with messages uses it too)")
    add_config_args(p, ProcessConfig)


def server_config(a: argparse.Namespace) -> ServerConfig:
    from kvseal.tenancy.tenant_file import TenantsFile, read_tenants_file

    f = read_tenants_file(a.api_keys) if a.api_keys is not None else TenantsFile((), (), ())
    return config_args.server_config(a, api_keys=f.keys, admin_keys=f.admins, tenants=f.tenants)


def chat_template(a: argparse.Namespace) -> str | None:
    """The text of --chat-template FILE (None without the flag); an unreadable file stops the start."""
    if a.chat_template is None:
        return None
    from kvseal.model.chat_template import compile_chat_template

    try:
        source = Path(a.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid --chat-template={a.chat_template!r}: cannot read it as UTF-8 text "
                         f"({type(exc).__name__}); give a jinja2 template file") from None
    try:
        compile_chat_template(source)
    except ValueError as exc:
        raise ValueError(f"invalid --chat-template={a.chat_template!r}: {exc}") from None
    return source


def one_tenant_notice(scfg: ServerConfig) -> None:
    if not scfg.api_keys:
        logging.getLogger("kvseal").warning(
            "no --api-keys: every client is one tenant and shares one prefix cache (a response's cached_tokens "
            "shows which prompt prefixes anyone sent before), and /info and /metrics show the whole fleet to "
            "everyone; give --api-keys FILE to keep tenants apart")


def serve_http(backend: Any, scfg: ServerConfig, log_level: str, engine: Engine | None = None,
               embedder: EmbedClient | None = None) -> None:
    """The OpenAI app over `backend` (the router's or the unified engine's), served until SIGTERM or SIGINT; with
    an embedder (`kvseal serve --embed-model`), /v1/embeddings too."""
    import uvicorn

    app = http_app(backend, scfg, engine, embedder)
    uvicorn.run(app, host=scfg.host, port=scfg.port, log_level=log_level, timeout_graceful_shutdown=5)


def http_app(backend: Any, scfg: ServerConfig, engine: Engine | None = None, embedder: EmbedClient | None = None,
             ) -> Any:
    """The app with /metrics (and the engine's own figures when it runs in this process) and /doctor/probe. A
    router's (engine None) imports no torch: tests/unit/test_house.py starts one and checks."""
    from kvseal.api.app import build_app
    from kvseal.metrics.router import MeteredBackend, RouterMetrics
    from kvseal.metrics.router import install as install_metrics
    from kvseal.router.probe import install_probe

    metrics = RouterMetrics(backend)
    if engine is not None:
        from kvseal.metrics.engine import EngineCollector, TenantCollector, WorkerMetrics

        WorkerMetrics(EngineCollector(engine, labels={"endpoint": f"{scfg.host}:{scfg.port}"}), metrics.registry)
        metrics.registry.register(TenantCollector(engine))  # this /metrics is admin keys' only: tenants may show
    app = build_app(MeteredBackend(backend, metrics), scfg, embedder)
    if embedder is not None:
        from kvseal.embed.metrics import EmbedMetrics

        app.state.embed_metrics = EmbedMetrics(metrics.registry, lambda: embedder.last_card.queued_inputs
                                               if embedder.last_card is not None else 0)
    install_metrics(app, metrics)
    install_probe(app, backend)
    return app
