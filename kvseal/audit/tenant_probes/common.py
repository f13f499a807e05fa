"""What every tenant probe shares: its context (one HTTP client, tenant A's and B's keys), its result shape, and
the rule that keys never leave the process (`redact` runs over the whole report before it is printed or written).

A probe answers one question about tenant B and tenant A with one of three verdicts:
  held            the server kept A's resource from B (and the probe could see the resource at work);
  broken          B saw, used or slowed A's resource: the evidence says how;
  not_applicable  the server has no such resource, or it could not be observed (a cache that never hits).
A probe that could not run at all (A's own requests refused, the server gone) raises ProbeError: the audit then
records "error" for it and exits 2 unless another probe is broken.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

Verdict = Literal["held", "broken", "not_applicable"]
TENANTS = ("A", "B")


class ProbeError(Exception):
    """The probe could not run (not a finding about isolation)."""


@dataclass(frozen=True)
class ProbeConfig:
    trials: int = 6  # prefix cache: fresh prompt pairs
    prompt_chars: int = 3000  # prefix cache: characters per prompt
    cache_salt_per_key: bool = False  # prefix cache: each tenant sends its own constant cache_salt
    noisy_samples: int = 20  # noisy neighbour: B's 1-token requests, alone and again under A's flood
    flood_concurrency: int = 8  # noisy neighbour: A's requests in flight at once
    flood_chars: int = 50_000  # noisy neighbour: characters of each of A's /tokenize bodies
    flood_chat_chars: int = 4000  # noisy neighbour: characters of each of A's chats (at most half the window)
    flood_max_s: float = 120.0  # noisy neighbour: B's sampling under the flood ends after this long
    status_paths: tuple[str, ...] = ("/metrics", "/info", "/slots")
    timeout: float = 120.0  # seconds per request


@dataclass(frozen=True)
class ProbeContext:
    client: httpx.AsyncClient  # no Authorization header of its own: every request names its tenant
    keys: dict[str, str]  # "A" / "B" -> bearer key (never printed, never written)
    model: str
    window: int | None  # advertised context window in tokens, when the server says
    rng: random.Random
    config: ProbeConfig
    run: str  # random per run (not from the seed): prompts that must be fresh start with it
    salts: dict[str, str] | None = None  # "A" / "B" -> cache_salt, with --cache-salt-per-key

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def extra(self, tenant: str) -> dict[str, Any]:
        """Body fields a generation request of `tenant` carries besides the prompt (its cache_salt)."""
        return {"cache_salt": self.salts[tenant]} if self.salts else {}


def result(probe: str, verdict: Verdict, summary: str, **evidence: Any) -> dict[str, Any]:
    return {"probe": probe, "verdict": verdict, "summary": summary, "evidence": evidence}


def error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])[:200]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


def json_of(r: httpx.Response) -> dict[str, Any]:
    """The body as a JSON object ({} when it is not one)."""
    try:
        body = r.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


async def timed_post(ctx: ProbeContext, tenant: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = await ctx.client.post(path, json=body, headers=ctx.auth(tenant))
    return r, time.perf_counter() - t0


def redact(obj: Any, keys: dict[str, str]) -> Any:
    """`obj` with every occurrence of a key (in any string, dict key included) replaced by `<key A>` / `<key B>`."""
    if isinstance(obj, str):
        for tenant, key in keys.items():
            obj = obj.replace(key, f"<key {tenant}>")
        return obj
    if isinstance(obj, dict):
        return {redact(k, keys): redact(v, keys) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v, keys) for v in obj]
    return obj
