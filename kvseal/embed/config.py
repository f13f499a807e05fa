"""`kvseal serve --embed-model PATH`: the embedding model served beside the chat model, and its worker's settings
(frozen, validated; the flags come from the fields, kvseal/config_args.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.config import _need, opt


@dataclass(frozen=True)
class EmbedConfig:
    model: str | None = opt(None, "also serve /v1/embeddings with this sentence-transformers folder (a BERT "
                            "encoder with its pooling config, e.g. all-MiniLM-L6-v2), in an embed worker process "
                            "beside the chat model (docs/embeddings.md)", flag="--embed-model")
    served_name: str | None = opt(None, "the embedding model's id in the API (default: the folder's name)",
                                  flag="--embed-model-name")
    threads: int | None = opt(None, "CPU threads of the embed worker (default: every core; it computes only while "
                              "embeddings are asked for)", flag="--embed-threads")
    batch_tokens: int = opt(8192, "tokens in one forward pass of the embed worker: larger batches are faster, and a "
                            "request of another tenant waits at most one batch", flag="--embed-batch-tokens")

    def __post_init__(self) -> None:
        _need(self.threads is None or self.threads >= 1, "embed_threads", self.threads, "give at least 1 thread")
        _need(self.batch_tokens >= 512, "embed_batch_tokens", self.batch_tokens,
              "give at least 512 tokens (a batch must hold the longest input)")
