"""Run a fake HTTP app (FastAPI) with uvicorn in a background thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Generator
from typing import Any

import uvicorn


def serve(app: Any) -> Generator[str, None, None]:
    """Yields the server's base URL; closing the generator stops the server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
