"""Typed, versioned messages between the API and an engine (in-process or over the wire).

msgspec Structs: encoded as msgpack on the wire, never pickled. `v` is the schema version; a peer that
receives a version it does not know refuses the message.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from kvseal.errors import ErrorInfo

SCHEMA_VERSION = 1


class ResponseFormat(msgspec.Struct, frozen=True):
    """Constrained decoding (engine/structured.py): "json_object", or "json_schema" with the schema as JSON."""

    type: str
    schema: str | None = None


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 -> off
    seed: int | None = None  # same seed, same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob and the top k
    min_tokens: int = 0
    response_format: ResponseFormat | None = None  # None: free text
    speculative: bool = True  # False: never draft for this request (the engine's --speculative decides otherwise)

    @property
    def greedy(self) -> bool:
        # as vLLM: a temperature this small is greedy (dividing logits by it would overflow float32)
        return self.temperature < 1e-5


class GenerateRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # the tenant the API key names ("" without --api-keys): with cache_salt it keys the prefix cache of prefill and
    # unified workers (decode keeps none) and the router's prefill affinity (seal 9)
    tenant: str = ""
    cache_salt: str | None = None  # splits a tenant's prefix cache further (OpenAI/vLLM's cache_salt)
    # the tenant's share and class from the router's tenants file (config.TenantPolicy), never from the client;
    # priority is the body's own (vLLM's meaning: lower first), and orders requests only within their tenant
    weight: float = 1.0
    priority_class: int = 0
    kv_share: float = 1.0
    priority: int = 0
    v: int = SCHEMA_VERSION


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []  # the top-k alternatives, best first


class GenerateDelta(msgspec.Struct, frozen=True):
    """New output of one request. The last delta of a request has `final` set, and only that one.

    final is "stop" or "length" (FINISHED) or "rejected"/"aborted"/"failed" with `error` set.
    """

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    final: str | None = None
    error: ErrorInfo | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (usage.prompt_tokens_details)
    v: int = SCHEMA_VERSION
    # on a final delta with `error`: the state the request was in when it ended, and the worker where it did
    # (for the router's one log line per failed request)
    stage: str | None = None
    worker: str | None = None


MAX_STOPS = 16  # a client's stop sequences (`stop`, `stop_sequences`): the API refuses more by name
# stops the router adds of its own, never the client's (a tool plan's end of a single call, kvseal/api/tools/plan.py):
# they do not count against the client's MAX_STOPS, and the client never sees them
MAX_ADDED_STOPS = 4


def response_format(kind: str, schema: Any = None) -> ResponseFormat:
    """The wire form of a response format: the schema as compact JSON text (its compile cache key too)."""
    text = None if schema is None else json.dumps(schema, separators=(",", ":"))  # key order is the order enforced
    return ResponseFormat(kind, text)
