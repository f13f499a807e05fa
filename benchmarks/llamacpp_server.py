"""`python -m llama_cpp.server`, changed in one way only: /v1/completions also takes a prompt of token ids.

    python -m benchmarks.llamacpp_server --model FILE.gguf --port 8002 [any llama_cpp.server flag]

llama-cpp-python's `Llama.create_completion` accepts `prompt: list[int]`, but its server's request model
only declares `str | list[str]`, so the token-id prompts `kvseal bench` sends (exactly --input-len tokens
each) would get 422. Before the server module is imported, this swaps in a subclass of the request model
whose validator turns a list of ints `[t0, t1, ...]` into `[[t0, t1, ...]]`; the endpoint then unwraps the
one-element list as it does for `[text]` and hands the ids to the model unchanged. Everything else
(scheduling, sampling, streaming) is llama-cpp-python's own. Needs `scripts/setup_baselines.sh`.
"""

from __future__ import annotations

import sys
from typing import Any


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def patch_token_id_prompts() -> type:
    """Replace llama_cpp.server.types.CreateCompletionRequest (must run before llama_cpp.server.app loads)."""
    import pydantic
    from llama_cpp.server import types as llama_types

    base: Any = llama_types.CreateCompletionRequest
    if base.__module__ == __name__:  # patched already
        return base
    if "llama_cpp.server.app" in sys.modules:
        raise RuntimeError("llama_cpp.server.app is already imported: patch before importing it")

    class CompletionRequestWithTokenIds(base):
        prompt: str | list[str] | list[list[int]] = pydantic.Field(
            default="", description="The prompt: text, [text], or a list of token ids.")

        @pydantic.field_validator("prompt", mode="before")
        @classmethod
        def _wrap_token_ids(cls, v: Any) -> Any:
            return [v] if _is_token_ids(v) else v

    CompletionRequestWithTokenIds.__name__ = base.__name__
    llama_types.CreateCompletionRequest = CompletionRequestWithTokenIds  # type: ignore[misc]
    return CompletionRequestWithTokenIds


def main(argv: list[str] | None = None) -> int:
    patch_token_id_prompts()
    from llama_cpp.server.__main__ import main as llama_main

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    llama_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
