"""What an embed worker runs with, as one typed message: `kvseal serve --embed-model` (embed/launch.py) sends it as
JSON on the worker's stdin (never argv or the environment: it holds the worker's fleet key)."""

from __future__ import annotations

import msgspec

from kvseal.auth.keys import MemberKeys


class EmbedSpec(msgspec.Struct, frozen=True, kw_only=True):
    model: str  # a sentence-transformers folder
    host: str = "127.0.0.1"
    port: int = 0
    threads: int | None = None  # torch threads (None: torch's default)
    batch_tokens: int = 8192  # tokens in one forward pass (a batch holds at least one input)
    log_level: str = "info"
    keys: MemberKeys | None = None  # fleet keys: CURVE, only allow-listed members (the router) get an answer
