"""Sampling parameters checked at the engine's door, whoever sent them.

The HTTP API validates its bodies, but an engine also takes requests from peers over the wire (the router, or a
hostile frame on a worker's port). A value no API request can carry must be refused here with its own error,
never reach sample() and fail the innocent requests that share its batch.
"""

from __future__ import annotations

import math

from kvseal.engine.messages import SamplingParams
from kvseal.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_STOPS = 16


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
    need(len(p.stop) <= MAX_STOPS and all(p.stop), "stop", p.stop, f"at most {MAX_STOPS} non-empty strings")
