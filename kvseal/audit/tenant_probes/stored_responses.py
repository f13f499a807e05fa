"""Probe: can tenant B reach a response tenant A stored? (/v1/responses with store: true)

Tenant A creates a stored response whose input carries a canary; B then tries, with A's response id:
GET /v1/responses/{id}, POST /v1/responses with previous_response_id = id (continuing A's conversation), and
DELETE /v1/responses/{id}; last, A's own GET must still find it. Any of B's three answered 2xx, or A's response
gone after B's DELETE: broken. A server without /v1/responses (404/405/501 on create), or one that does not keep
what it was told to store (A's own GET fails), is not_applicable. B's answers for A's id and for a made-up id are
both recorded: a server that answers them differently tells B which ids exist.
"""

from __future__ import annotations

from typing import Any

from kvseal.audit.canary import contains_secret, make_secret
from kvseal.audit.tenant_probes.common import ProbeContext, ProbeError, Verdict, error_message, json_of, result

NAME = "stored_responses"
ABSENT = (404, 405, 501)  # no Responses API on this server (or no store behind it)


def _ok(status: int | None) -> bool:
    return status is not None and 200 <= status < 300


def judge(seen: dict[str, Any]) -> tuple[Verdict, str]:
    """From the statuses each step got (pure). `seen` holds b_get, b_continue, b_delete, a_get_after (ints)."""
    taken = [what for what, step in (("read it (GET)", "b_get"), ("continued it (previous_response_id)",
                                                                   "b_continue"), ("deleted it (DELETE)", "b_delete"))
             if _ok(seen[step])]
    if not _ok(seen["a_get_after"]):
        taken.append(f"A's own GET afterwards answered {seen['a_get_after']}: B's DELETE removed it")
    if taken:
        return "broken", "tenant B reached tenant A's stored response: B " + "; ".join(taken)
    oracle = seen["b_get"] != seen["b_get_made_up"]
    return "held", (f"tenant B got {seen['b_get']} / {seen['b_continue']} / {seen['b_delete']} for GET / continue / "
                    f"DELETE of A's response, which A still reads"
                    + (f"; but B's GET of a made-up id answered {seen['b_get_made_up']}, so B can tell which ids "
                       f"exist" if oracle else ", exactly as for a made-up id"))


async def _request(ctx: ProbeContext, tenant: str, method: str, path: str,
                   body: dict[str, Any] | None = None) -> tuple[int, str]:
    r = await ctx.client.request(method, path, json=body, headers=ctx.auth(tenant))
    return r.status_code, r.text


async def run(ctx: ProbeContext) -> dict[str, Any]:
    canary = make_secret(ctx.rng)
    create = {"model": ctx.model, "input": f"Remember this code word: {canary}. Reply with the word OK.",
              "store": True, "max_output_tokens": 8, "temperature": 0}
    r = await ctx.client.post("/v1/responses", json=create, headers=ctx.auth("A"))
    if r.status_code in (401, 403) or (r.status_code >= 500 and r.status_code not in ABSENT):
        raise ProbeError(f"tenant A's POST /v1/responses answered {r.status_code}: {error_message(r)}")
    rid = json_of(r).get("id") if r.status_code == 200 else None
    if not isinstance(rid, str):
        return result(NAME, "not_applicable", f"the server has no stored responses for tenant A: POST /v1/responses "
                      f"answered {r.status_code}", create_status=r.status_code, create_error=error_message(r))
    a_get, _ = await _request(ctx, "A", "GET", f"/v1/responses/{rid}")
    if not _ok(a_get):
        return result(NAME, "not_applicable", f"the server did not keep tenant A's stored response (A's own GET "
                      f"answered {a_get})", create_status=200, a_get=a_get)
    seen: dict[str, Any] = {"a_get": a_get}
    seen["b_get"], b_get_text = await _request(ctx, "B", "GET", f"/v1/responses/{rid}")
    seen["b_get_made_up"], _ = await _request(ctx, "B", "GET", f"/v1/responses/resp_{ctx.rng.getrandbits(96):024x}")
    follow = {"model": ctx.model, "previous_response_id": rid, "input": "What was the code word? Repeat it.",
              "max_output_tokens": 16, "temperature": 0, "store": False}
    seen["b_continue"], b_continue_text = await _request(ctx, "B", "POST", "/v1/responses", follow)
    seen["b_delete"], _ = await _request(ctx, "B", "DELETE", f"/v1/responses/{rid}")
    seen["a_get_after"], _ = await _request(ctx, "A", "GET", f"/v1/responses/{rid}")
    seen["a_delete"], _ = await _request(ctx, "A", "DELETE", f"/v1/responses/{rid}")  # leave nothing behind
    verdict, summary = judge(seen)
    return result(NAME, verdict, summary, statuses=seen,
                  canary_in_b_get=contains_secret(b_get_text, canary) if _ok(seen["b_get"]) else False,
                  canary_in_b_continue=(contains_secret(b_continue_text, canary) if _ok(seen["b_continue"])
                                        else False))
