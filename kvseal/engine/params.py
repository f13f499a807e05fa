"""A request checked at the engine's door, whoever sent it: its window, its sampling parameters, its tenant's figures.

The HTTP API validates its bodies, but an engine also takes requests from peers over the wire (the router, or a
hostile frame on a worker's port). A value no API request can carry must be refused here with its own error,
never reach sample() and fail the innocent requests that share its batch.
"""

from __future__ import annotations

import math

from kvseal.errors import ContextLengthExceeded, InvalidRequest
from kvseal.wire.messages import MAX_ADDED_STOPS, MAX_STOPS, SCHEMA_VERSION, GenerateRequest, SamplingParams

MAX_LOGPROBS = 20


def check_sampling(p: SamplingParams) -> None:
    def need(ok: bool, param: str, value: object, allowed: str) -> None:
        if not ok:
            raise InvalidRequest(f"{param}={value!r} is out of range: {allowed}", param=param)

    need(math.isfinite(p.temperature) and 0.0 <= p.temperature <= 2.0, "temperature", p.temperature,
         "give 0 to 2")
    need(math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0, "top_p", p.top_p, "give more than 0, at most 1")
    need(p.top_k >= 0, "top_k", p.top_k, "give 0 (off) or more")
    need(p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs", p.logprobs,
         f"give 0 to {MAX_LOGPROBS}")
    need(p.min_tokens >= 0, "min_tokens", p.min_tokens, "give 0 or more")
    most = MAX_STOPS + MAX_ADDED_STOPS
    need(len(p.stop) <= most and all(p.stop), "stop", p.stop, f"at most {most} non-empty strings")


def check_window(num_prompt: int, max_tokens: int, context_window: int) -> None:
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if num_prompt + max_tokens > context_window:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {context_window} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
            f"the completion). Please reduce the length of the messages or completion.",
            param="messages",
        )


def check_request(req: GenerateRequest, context_window: int, vocab_size: int) -> None:
    """Everything about req alone (not the engine's load): raises the error that refuses it."""
    if req.v != SCHEMA_VERSION:
        raise InvalidRequest(f"message schema v{req.v} is not v{SCHEMA_VERSION}: upgrade the peer")
    check_window(len(req.prompt_ids), req.params.max_tokens, context_window)
    check_sampling(req.params)
    if not (0 < req.weight <= 1e6 and 0 < req.kv_share <= 1):  # from the router: a peer's frame, checked
        raise InvalidRequest(f"weight {req.weight} or kv_share {req.kv_share} out of range")
    if any(t < 0 or t >= vocab_size for t in req.prompt_ids):
        raise InvalidRequest("a prompt token id is outside the vocabulary", param="prompt")
