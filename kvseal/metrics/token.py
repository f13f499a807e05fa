"""Who sees what on a worker's metrics port: the metrics token (`--metrics-token-file`).

    no Authorization header         200: the fleet-level families (pool, counters, histograms, worker_info);
                                    no tenant name anywhere (what the kubelet's probes and a plain scrape get)
    Authorization: Bearer TOKEN     200: the same and every tenant's figures (kvseal:tenant_*{tenant})
    any other Authorization         401 with `WWW-Authenticate: Bearer`: a stale or wrong token fails the scrape
                                    (Prometheus marks the target down and says 401) instead of silently
                                    dropping every per-tenant series

The token is kept only as its SHA-256 digest from the moment the file is read (it reaches `kvseal serve`'s
workers in their WorkerSpec that way); a presented token is hashed and the digests compared in constant time.
No message ever echoes the token.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import socket
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.exposition import ThreadingWSGIServer

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
MIN_CHARS = 16
MAKE_ONE = "e.g. `openssl rand -hex 32 > FILE`"
REFUSED = (b"401: this scrape's Authorization is not the metrics token. Send `Authorization: Bearer TOKEN` with "
           b"the token in the worker's --metrics-token-file (Prometheus: authorization.credentials_file) to see "
           b"every tenant's figures, or no Authorization header for the fleet-level metrics alone.\n")


def add_metrics_token_arg(p: argparse.ArgumentParser, serve: bool = False) -> None:
    whose = "every worker's" if serve else "this worker's"
    p.add_argument("--metrics-token-file", default=None, metavar="FILE",
                   help=f"a file holding the metrics token ({MIN_CHARS}+ printable characters, {MAKE_ONE}): "
                        f"{whose} metrics port then shows every tenant's figures (kvseal:tenant_*) to a scrape "
                        f"that sends `Authorization: Bearer TOKEN`; without it, or without the header, the port "
                        f"shows fleet-level figures only, no tenant names")


def token_sha256(path: str | None) -> str | None:
    """The SHA-256 hex digest of the token in `path` (surrounding whitespace dropped, as Prometheus drops it from
    a credentials_file); None without a path. A file that cannot be a token stops the start (ValueError)."""
    if path is None:
        return None
    where = f"invalid --metrics-token-file={path!r}"
    try:
        token = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot read it as ASCII text ({type(exc).__name__}); give a file holding the "
                         f"token alone, {MAKE_ONE}") from None
    if len(token) < MIN_CHARS:
        raise ValueError(f"{where}: it holds {len(token)} characters; the token is at least {MIN_CHARS} "
                         f"printable characters, {MAKE_ONE}")
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{where}: the token holds spaces or control characters (it travels in an HTTP header); "
                         f"give printable characters without spaces, {MAKE_ONE}")
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def bearer_matches(authorization: str, sha256: str | None) -> bool:
    """Whether an Authorization header carries the token whose digest is `sha256` (constant time in the token)."""
    scheme, _, token = authorization.strip().partition(" ")
    given = hashlib.sha256(token.strip().encode("latin-1", "replace")).hexdigest()
    return sha256 is not None and scheme.lower() == "bearer" and hmac.compare_digest(given, sha256)


def gated(public: WSGIApp, full: WSGIApp, sha256: str | None) -> WSGIApp:
    """One app in front of two: `full` for the metrics token, `public` without a header, 401 for the rest."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        authorization = environ.get("HTTP_AUTHORIZATION")
        if not authorization:
            return public(environ, start_response)
        if bearer_matches(authorization, sha256):
            return full(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="kvseal metrics"')])
        return [REFUSED]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (as prometheus_client's own server)."""


def serve_wsgi(host: str, port: int, app: WSGIApp) -> WSGIServer:
    """`app` on host:port (0: any free port; IPv4 or IPv6 as the host says), one daemon thread per request."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family

    server: WSGIServer = make_server(host, port, app, Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="kvseal-metrics", daemon=True).start()
    return server
