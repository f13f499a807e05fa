"""`kvseal router`: the OpenAI API in front of prefill and decode workers started apart. Its flags: the model's
(for its tokenizer), the HTTP front's, RouterConfig's, HandoffTimeouts', the ledger's and the fleet keys; `kvseal
serve` runs the same router (run_router) in front of the workers it starts."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import TYPE_CHECKING

from kvseal.auth.curve import check_bind
from kvseal.auth.options import add_fleet_key_args, member_keys, peer
from kvseal.cli.base import Subparsers, command
from kvseal.cli.front import add_server_args, chat_template, one_tenant_notice, serve_http, server_config
from kvseal.config import LedgerConfig, ModelConfig, ServerConfig
from kvseal.config_args import add_config_args, config_from_args, ledger_path
from kvseal.config_fleet import HandoffTimeouts, ProcessConfig, RouterConfig
from kvseal.errors import KvsealError

if TYPE_CHECKING:
    from kvseal.auth.keys import MemberKeys
    from kvseal.embed.launch import EmbedSide
    from kvseal.router.disagg import DisaggBackend

# the model for its tokenizer, the window to serve (default: the workers' model window) and the model id
ROUTER_MODEL = ("path", "max_model_len", "served_name")


def add_parser(sub: Subparsers[argparse.ArgumentParser]) -> None:
    p = command(sub, "router", "serve the OpenAI API in front of prefill and decode workers")
    add_config_args(p, ModelConfig, only=ROUTER_MODEL)
    add_config_args(p, RouterConfig)
    add_config_args(p, HandoffTimeouts)
    add_server_args(p)
    add_fleet_key_args(p)
    add_config_args(p, LedgerConfig)
    p.set_defaults(func=cmd_router)


def cmd_router(a: argparse.Namespace) -> int:
    rcfg = config_from_args(RouterConfig, a)
    if not rcfg.prefill or not rcfg.decode:
        print("kvseal router: give at least one --prefill HOST:PORT and one --decode HOST:PORT", file=sys.stderr)
        return 2
    keys = member_keys(a, "router")
    scfg = server_config(a)
    fleet_host(rcfg, scfg, keys)  # refused before anything starts
    prefill = [peer(a, x, keys, "prefill") for x in rcfg.prefill]
    decode = [peer(a, x, keys, "decode") for x in rcfg.decode]
    server_keys = {ep: k for ep, k in prefill + decode if k is not None}
    return run_router(a, scfg, [ep for ep, _ in prefill], [ep for ep, _ in decode], chat_template(a), keys,
                      server_keys)


def fleet_host(rcfg: RouterConfig, scfg: ServerConfig, keys: MemberKeys | None) -> str:
    """Where the router's fleet socket binds; off loopback only with keys (ValueError naming the fix)."""
    host = rcfg.fleet_host or scfg.host
    check_bind(host, keys, "router's fleet port (--fleet-host, default --host)", "--fleet-host" if rcfg.fleet_host
               else "--host")
    return str(host)


def run_router(a: argparse.Namespace, scfg: ServerConfig, prefill: list[str], decode: list[str],
               template: str | None, keys: MemberKeys | None = None,
               server_keys: dict[str, str] | None = None, embed: EmbedSide | None = None) -> int:
    """The router over these workers' control endpoints, with the configs its command's flags give."""
    backend = router_backend(a, scfg, prefill, decode, template, keys, server_keys)
    logging.getLogger("kvseal").info("router on http://%s:%d: prefill %s, decode %s; ledger %s; fleet %s", scfg.host,
                                     scfg.port, prefill, decode, ledger_path(a) or "off",
                                     "authenticated and encrypted (CURVE)" if keys is not None else "without keys")
    one_tenant_notice(scfg)
    try:  # seal 7 before the first request: a fleet that cannot hold the window never serves
        asyncio.run(_probe(backend))
    except KvsealError as err:
        print(f"kvseal router: refusing to start: {err.message}", file=sys.stderr)
        return 3
    serve_http(backend, scfg, config_from_args(ProcessConfig, a).log_level,
               embedder=embed.client if embed is not None else None)
    if backend.ledger is not None:
        backend.ledger.close()
    return 0


def router_backend(a: argparse.Namespace, scfg: ServerConfig, prefill: list[str], decode: list[str],
                   template: str | None, keys: MemberKeys | None = None,
                   server_keys: dict[str, str] | None = None) -> DisaggBackend:
    """The router's DisaggBackend from its command's configs (the model's, RouterConfig, HandoffTimeouts, the
    ledger's and the process's), over these workers' control endpoints."""
    from kvseal.faults import hooks_from_spec
    from kvseal.ledger.store import Ledger
    from kvseal.model.locate import load_tokenizer
    from kvseal.router.disagg import DisaggBackend

    model, rcfg = config_from_args(ModelConfig, a), config_from_args(RouterConfig, a)
    hooks = hooks_from_spec(config_from_args(ProcessConfig, a).test_faults, "kvseal router")
    tokenizer, name = load_tokenizer(model.path)
    path = ledger_path(a)
    if template is not None:
        tokenizer = tokenizer.with_chat_template(template)
    return DisaggBackend(tokenizer, model.served_name or name, prefill, decode, max_model_len=model.max_model_len,
                         startup_timeout_s=rcfg.startup_timeout_s, timeouts=config_from_args(HandoffTimeouts, a),
                         hooks=hooks, fleet_bind=f"tcp://{fleet_host(rcfg, scfg, keys)}:{rcfg.fleet_port}",
                         ledger=Ledger(path) if path else None, keys=keys, server_keys=server_keys)


async def _probe(backend: DisaggBackend) -> None:
    try:
        await backend.start()
    finally:
        await backend.stop()
