"""What the OpenAI front end needs from whatever runs the model: one engine in-process, or a fleet of
prefill and decode workers behind a router. The API layer is the same for both."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol

from kvseal.model.tokenizer import Tokenizer
from kvseal.wire.messages import GenerateDelta, GenerateRequest


class Backend(Protocol):
    model_name: str
    tokenizer: Tokenizer
    context_window: int  # the served window: prompts are checked against it before any worker sees them

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, req: GenerateRequest) -> AsyncGenerator[GenerateDelta, None]:
        """Yields deltas; the last one has `final` set. Closing the iterator early aborts the request."""
        ...

    async def info(self) -> dict[str, Any]: ...

    async def healthy(self) -> bool: ...
