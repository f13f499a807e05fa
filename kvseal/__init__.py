"""kvseal: a disaggregated LLM inference server whose KV cache is sealed per request."""

__version__ = "0.1.0"
