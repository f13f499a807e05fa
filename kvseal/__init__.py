"""kvseal: a disaggregated LLM inference server whose KV cache is sealed per request.

`from kvseal import LLM, SamplingParams` is the Python API (kvseal/llm.py); it loads torch on first use only,
so `import kvseal` (the CLI, `kvseal bench`) stays light.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput", "RequestOutput", "SamplingParams"):
        from kvseal import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'kvseal' has no attribute {name!r}")
