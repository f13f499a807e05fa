"""Probe: what do the status pages (/metrics, /info, llama.cpp's /slots) show tenant B about tenant A?

Tenant A asks its own /info who it is (its tenant name, where the server says), then sends a chat whose prompt and
`user` field carry a canary; B reads every status page while that chat is in flight and again after it. Broken:
B's view holds A's key, a hash of it, A's tenant name or A's canary, or figures labelled with a tenant other than
B (a `tenant`/`user`/... label or field). Pages B is refused (401/403) hold; when no page exists (404 everywhere)
the probe is not_applicable. Fleet-wide figures that A's chat moved (a request counter anyone can read) are
recorded as evidence, not judged: they tell B how busy the server is, not who made it busy.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Any

from kvseal.audit.canary import contains_secret, make_secret, snippet
from kvseal.audit.tenant_probes.common import ProbeContext, ProbeError, Verdict, error_message, json_of, result

NAME = "status_pages"
TENANT_FIELDS = frozenset({"tenant", "tenant_id", "tenant_name", "user", "user_id", "api_key", "key", "key_id",
                           "key_name", "customer", "org", "organization", "project", "team", "owner"})
TENANT_MAPS = frozenset({"tenants", "per_tenant", "by_tenant", "users", "keys"})  # {name: figures}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", re.MULTILINE)
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
IN_FLIGHT_DELAY_S = 0.2  # B looks this long after A's chat was sent (it is still running)


def tenant_values(text: str) -> set[str]:
    """Every value of a tenant-like Prometheus label or JSON field (or key of a per-tenant map) in `text`."""
    found: set[str] = set()
    for m in _SAMPLE.finditer(text):
        for label, value in _LABEL.findall(m.group(2) or ""):
            if label.lower() in TENANT_FIELDS and value:
                found.add(value)
    try:
        _walk(json.loads(text), found)
    except ValueError:
        pass
    return found


def _walk(obj: Any, found: set[str]) -> None:
    if isinstance(obj, list):
        for v in obj:
            _walk(v, found)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if str(k).lower() in TENANT_FIELDS and isinstance(v, str | int) and not isinstance(v, bool) and v != "":
                found.add(str(v))
            elif str(k).lower() in TENANT_MAPS and isinstance(v, dict):
                found.update(str(name) for name in v)
            _walk(v, found)


def samples(text: str) -> dict[str, str]:
    """Prometheus sample lines: `name{labels}` -> value."""
    return {m.group(1) + (m.group(2) or ""): m.group(3) for m in _SAMPLE.finditer(text)}


def own_name(info: dict[str, Any]) -> str | None:
    """The tenant name a server's /info gives the caller (kvseal: "tenant"), if it gives one."""
    for field in ("tenant", "tenant_id", "user", "owner"):
        v = info.get(field)
        if isinstance(v, str) and v:
            return v
    return None


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_.-]){re.escape(word)}(?![A-Za-z0-9_.-])", text) is not None


def judge(views: dict[str, dict[str, Any]], a_ids: dict[str, str], canary: str,
          b_name: str | None) -> tuple[Verdict, str, dict[str, Any]]:
    """(verdict, summary, findings by path) from what B saw: `views` maps a path to {"status", "text"} (the text
    of every look at it joined); `a_ids` maps a description to one of A's identifiers (pure)."""
    readable = {p: v for p, v in views.items() if v["status"] == 200}
    findings: dict[str, list[str]] = {}
    for path, v in readable.items():
        text, found = v["text"], []
        found += [f"{what} ({snippet(text, needle, 40)!r})" for what, needle in a_ids.items()
                  if (_has_word(text, needle) if what == "A's tenant name" else needle.lower() in text.lower())]
        if contains_secret(text, canary):
            found.append(f"A's canary ({snippet(text, canary, 40)!r})")
        others = tenant_values(text) - ({b_name} if b_name else set())
        if others and (b_name is not None or len(others) > 1 or a_ids.get("A's tenant name") in others):
            found.append(f"figures of other tenants: {sorted(others)[:10]}")
        if found:
            findings[path] = found
    statuses = {p: v["status"] for p, v in views.items()}
    if findings:
        return "broken", "tenant B sees tenant A: " + "; ".join(f"{p}: {', '.join(f)}" for p, f in
                                                                   findings.items()), findings
    if not readable:
        if all(s == 404 for s in statuses.values()):
            return "not_applicable", f"no status page exists ({statuses})", findings
        return "held", f"tenant B is refused every status page ({statuses})", findings
    return "held", (f"tenant B reads {sorted(readable)} and finds nothing of tenant A's (no key, name or canary, "
                    f"no per-tenant figures); statuses {statuses}"), findings


async def look(ctx: ProbeContext, paths: tuple[str, ...]) -> dict[str, tuple[int, str]]:
    answers = await asyncio.gather(*(ctx.client.get(p, headers=ctx.auth("B")) for p in paths))
    return {p: (r.status_code, r.text) for p, r in zip(paths, answers)}


def moved(before: str, after: str) -> list[str]:
    """Prometheus samples whose value changed between two reads (fleet-wide figures A's traffic moved)."""
    old, new = samples(before), samples(after)
    return sorted(k for k, v in new.items() if k in old and old[k] != v)


async def run(ctx: ProbeContext) -> dict[str, Any]:
    paths = ctx.config.status_paths
    infos = await asyncio.gather(*(ctx.client.get("/info", headers=ctx.auth(t)) for t in ("A", "B")))
    a_name, b_name = (own_name(json_of(r)) if r.status_code == 200 else None for r in infos)
    before = await look(ctx, paths)
    canary = make_secret(ctx.rng)
    chat = {"model": ctx.model, "max_tokens": 48, "temperature": 0, "user": f"user-{canary}",
            "messages": [{"role": "user", "content": f"My account code is {canary}. Write a short poem about it."}]}
    a_chat = asyncio.create_task(ctx.client.post("/v1/chat/completions", json=chat, headers=ctx.auth("A")))
    await asyncio.sleep(IN_FLIGHT_DELAY_S)
    during = await look(ctx, paths)
    r = await a_chat
    if r.status_code != 200:
        raise ProbeError(f"tenant A's canary chat answered {r.status_code}: {error_message(r)}")
    after = await look(ctx, paths)
    views: dict[str, dict[str, Any]] = {p: {"status": after[p][0], "text": f"{during[p][1]}\n{after[p][1]}"}
                                        for p in paths}
    key_a = ctx.keys["A"]
    a_ids = {"A's key": key_a, "a sha256 of A's key": hashlib.sha256(key_a.encode()).hexdigest()[:16]}
    if a_name and a_name != b_name:
        a_ids["A's tenant name"] = a_name
    verdict, summary, findings = judge(views, a_ids, canary, b_name)
    metrics = "/metrics" if "/metrics" in paths and before["/metrics"][0] == after["/metrics"][0] == 200 else None
    fleet = moved(before[metrics][1], after[metrics][1]) if metrics else []
    if fleet:
        summary += f"; {len(fleet)} fleet-wide figures on /metrics moved with A's chat (e.g. {fleet[0]})"
    return result(NAME, verdict, summary, findings=findings, a_tenant_name=a_name, b_tenant_name=b_name,
                  one_tenant=a_name is not None and a_name == b_name,
                  statuses={p: {"before": before[p][0], "during": during[p][0], "after": after[p][0]} for p in paths},
                  bytes_seen={p: len(v["text"]) for p, v in views.items()},
                  fleet_figures_moved_by_a=fleet[:20])
