"""Judging the audit's results: violations with evidence, counts, latencies, the verdict, the table and JSON."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

from kvseal.audit.canary import contains_secret, find_foreign_secrets, snippet
from kvseal.audit.runner import Result

LOW_ECHO = 0.5  # below this canary echo rate the table warns that the leak check is weak
MIN_LONG = 5  # long-prompt answers needed before their echo rate is judged


def kind_of(res: Result) -> str:
    return res.spec.endpoint + ("+stream" if res.spec.stream else "")


def status_bucket(res: Result) -> str:
    if res.outcome in ("stream_error", "timeout", "cancelled"):
        return res.outcome  # a 200 stream that broke off or ran out of time counts here, not as a 200
    if res.status is not None:
        return "200" if res.status == 200 else f"{res.status // 100}xx"
    return {"transport_error": "transport"}.get(res.outcome, res.outcome)


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (q in [0, 1]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    return xs[min(max(math.ceil(q * len(xs)) - 1, 0), len(xs) - 1)]


def _violation(kind: str, res: Result, detail: str, **evidence: Any) -> dict[str, Any]:
    return {"kind": kind, "request": res.spec.index, "endpoint": kind_of(res), "status": res.status,
            "detail": detail, "evidence": evidence}


def find_violations(results: list[Result], secrets: dict[str, int], strict: bool) -> tuple[list[dict[str, Any]],
                                                                                              dict[str, Any]]:
    """(violations, consistency summary). `secrets` maps every secret issued in the run to its request
    index (-1 for the calibration request)."""
    pool = frozenset(secrets)
    out: list[dict[str, Any]] = []
    for res in results:
        texts = [res.text] + ([json.dumps(res.error)] if res.error else [])
        for text in texts:
            for s in find_foreign_secrets(text, res.spec.secret, pool):
                out.append(_violation("leak", res, f"response carries the secret of request {secrets[s]}",
                                      secret=s, owner=secrets[s], snippet=snippet(text, s)))
        if res.spec.over_window and res.status == 200:
            out.append(_violation("over_window_200", res, "a prompt above the advertised window was answered "
                                  "200 instead of a 4xx error", target_tokens=res.spec.target_tokens,
                                  prompt_chars=res.prompt_chars, server_prompt_tokens=res.prompt_tokens,
                                  finish_reason=res.finish_reason, text=res.text[:200]))
        if res.spec.over_window and res.status is not None and res.status >= 500:
            out.append(_violation("5xx_for_over_window", res, f"HTTP {res.status} where a 4xx is due",
                                  error=res.error))
        for p in res.problems:
            kind = ("bad_error_format" if res.outcome == "http_error" or p.startswith("stream error event")
                    else "broken_stream" if p.startswith("stream") else "bad_response_format")
            out.append(_violation(kind, res, p, error=res.error))
    solo = {r.spec.consistency: r for r in results if r.spec.consistency is not None and r.spec.phase == "solo"}
    pairs = [(solo[r.spec.consistency], r) for r in results
             if r.spec.consistency is not None and r.spec.phase == "load" and r.spec.consistency in solo]
    compared = [(a, b) for a, b in pairs if a.status == 200 and b.status == 200]
    differing = [(a, b) for a, b in compared if a.text != b.text]
    if strict:
        for a, b in differing:
            out.append(_violation("inconsistent_under_load", b, f"greedy answer differs from the answer given "
                                  f"alone (request {a.spec.index})", alone=a.text[:200], under_load=b.text[:200]))
    consistency = {"prompts": len(solo), "compared": len(compared), "differing": len(differing),
                   "rate": len(differing) / len(compared) if compared else None, "strict": strict,
                   "examples": [{"alone": a.text[:120], "under_load": b.text[:120]} for a, b in differing[:5]]}
    return out, consistency


def _error_label(res: Result) -> str:
    if res.status == 200:
        return "200 accepted"
    err = res.error or {}
    label = err.get("code") or err.get("type") or "(no error code)"
    return f"{res.status} {label}" if res.status is not None else res.outcome


def echo_by_length(results: list[Result]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Canary echo rate of the shorter and the longer half of in-window prompts, and a violation when long
    prompts stop being read: a server that swaps a prompt for a stand-in (the 2026 incident's one-token
    placeholder) still answers 200, but the answer no longer repeats that prompt's secret."""
    canaries = [r for r in results if r.spec.secret and not r.spec.over_window and r.status == 200
                and r.outcome == "ok"]
    if not canaries:
        return {"short": None, "long": None}, []
    cut = max(r.spec.target_tokens for r in canaries) / 2
    bands = {"short": [r for r in canaries if r.spec.target_tokens < cut],
             "long": [r for r in canaries if r.spec.target_tokens >= cut]}
    rates = {k: (sum(contains_secret(r.text, r.spec.secret or "") for r in v) / len(v) if v else None)
             for k, v in bands.items()}
    summary = {k: {"answered": len(bands[k]), "rate": rates[k]} for k in bands}
    short, long_ = rates["short"], rates["long"]
    out = []
    if short is not None and long_ is not None and len(bands["long"]) >= MIN_LONG and short >= 0.6 \
            and long_ < short / 2:
        missed = [r for r in bands["long"] if not contains_secret(r.text, r.spec.secret or "")]
        out.append(_violation(
            "long_prompts_ignored", missed[0],
            f"answers to long prompts stopped reflecting their own prompt: echo rate {long_:.0%} for prompts "
            f"of at least {cut:.0f} tokens vs {short:.0%} for shorter ones; the server may be replacing or "
            f"truncating long prompts while answering 200", examples=[r.text[:80] for r in missed[:5]]))
    return summary, out


def build_report(results: list[Result], secrets: dict[str, int], strict: bool, meta: dict[str, Any],
                 planned: int, min_completed: float) -> dict[str, Any]:
    violations, consistency = find_violations(results, secrets, strict)
    echo_bands, ignored = echo_by_length(results)
    violations += ignored
    canaries = [r for r in results if r.spec.secret and not r.spec.over_window and r.status == 200
                and r.outcome == "ok"]
    echoed = sum(contains_secret(r.text, r.spec.secret or "") for r in canaries)
    over = [r for r in results if r.spec.over_window]
    in_window = [r for r in results if not r.spec.over_window]
    rejected_in = [r for r in in_window if r.status is not None and 400 <= r.status < 500]
    failed_in = [r for r in in_window if r.status is not None and r.status >= 500]
    completed = sum(r.status is not None for r in results)
    report: dict[str, Any] = {
        **meta,
        "planned": planned, "completed": completed,
        "cancelled": sum(r.outcome == "cancelled" for r in results),
        "by_kind": _by_kind(results),
        "canary_echo": {"answered": len(canaries), "echoed_own_secret": echoed,
                        "rate": echoed / len(canaries) if canaries else None, "by_length": echo_bands},
        "leaks": sum(v["kind"] == "leak" for v in violations),
        "over_window": {"sent": len(over), "results": dict(Counter(_error_label(r) for r in over))},
        "in_window_rejected": {"count": len(rejected_in),
                               "results": dict(Counter(_error_label(r) for r in rejected_in))},
        "consistency": consistency,
        "violation_counts": dict(Counter(v["kind"] for v in violations)),
        "violations": violations,
    }
    notes: list[str] = []
    if violations:
        verdict, code = "FAIL", 1
    elif completed < min_completed * planned:
        verdict, code = "INCONCLUSIVE", 2
        notes.append(f"only {completed} of {planned} requests completed (need {min_completed:.0%})")
    elif not canaries:
        verdict, code = "INCONCLUSIVE", 2
        notes.append("no in-window canary request was answered 200: nothing to check for leaks")
    else:
        verdict, code = "PASS", 0
    notes += _caveats(report["canary_echo"]["rate"], rejected_in, failed_in, bool(consistency["rate"]) and not strict)
    report.update(verdict=verdict, exit_code=code, notes=notes,
                  requests=[_record(r) for r in sorted(results, key=lambda r: r.spec.index)])
    return report


def _by_kind(results: list[Result]) -> dict[str, Any]:
    """Per kind of request: how many were sent, their statuses, and their latencies."""
    by_kind: dict[str, Any] = {}
    for k in sorted({kind_of(r) for r in results}):
        rs = [r for r in results if kind_of(r) == k]
        lat = [r.latency_s for r in rs if r.status == 200 and r.latency_s is not None]
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        by_kind[k] = {"sent": len(rs), "statuses": dict(Counter(status_bucket(r) for r in rs)),
                      "latency_median_s": quantile(lat, 0.5), "latency_p99_s": quantile(lat, 0.99),
                      "ttft_median_s": quantile(ttft, 0.5)}
    return by_kind


def _caveats(echo_rate: float | None, rejected_in: list[Result], failed_in: list[Result], changed: bool) -> list[str]:
    """What weakens the verdict, whatever it is: a low echo rate, in-window prompts refused or failed, greedy answers
    that changed under load (`changed`: and that is no violation)."""
    notes = []
    if echo_rate is not None and echo_rate < LOW_ECHO:
        notes.append(f"canary echo rate {echo_rate:.0%} is low: the model rarely repeats its own secret, so a leak "
                     "would show less often; the leak check is weaker than it looks")
    if rejected_in:
        notes.append(f"{len(rejected_in)} in-window prompts were rejected with a 4xx (sizing estimate too large, "
                     "or the server serves less than it advertises)")
    if failed_in:
        codes = Counter(_error_label(r) for r in failed_in)
        notes.append(f"{len(failed_in)} in-window requests failed with a 5xx ("
                     + ", ".join(f"{n}x {k}" for k, n in codes.most_common()) + "); if the server is overloaded, "
                     "a lower --concurrency lets more canaries through")
    if changed:
        notes.append("greedy answers changed under load (not a violation without --strict)")
    return notes


def _record(r: Result) -> dict[str, Any]:
    s = r.spec
    return {"index": s.index, "endpoint": s.endpoint, "stream": s.stream, "phase": s.phase,
            "over_window": s.over_window, "consistency": s.consistency, "secret": s.secret,
            "target_tokens": s.target_tokens, "prompt_chars": r.prompt_chars, "prompt_tokens": r.prompt_tokens,
            "outcome": r.outcome, "status": r.status, "latency_s": r.latency_s, "ttft_s": r.ttft_s,
            "finish_reason": r.finish_reason,
            "echoed": contains_secret(r.text, s.secret) if s.secret and r.outcome == "ok" and r.status == 200
            else None,
            "error": r.error, "problems": r.problems, "text": r.text[:300]}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def render(report: dict[str, Any]) -> str:
    """The human-readable summary printed to stdout."""
    lines = [(f"kvseal audit of {report['target']}  model {report['model']}  context window "
              f"{report['context_window']} ({report['window_source']})"),
             (f"requests: {report['planned']} planned, {report['completed']} answered, {report['cancelled']} "
              f"cancelled, in {report['duration_s']:.1f} s"), ""]
    cols = ["200", "4xx", "5xx", "timeout", "transport", "stream_error", "cancelled"]
    w = {c: max(len(c) + 2, 6) for c in cols}
    head = f"{'kind':<18}{'sent':>6}" + "".join(f"{c:>{w[c]}}" for c in cols)
    lines += [head + f"{'p50 ms':>9}{'p99 ms':>9}{'ttft50':>8}", "-" * (len(head) + 26)]
    for k, v in report["by_kind"].items():
        st = v["statuses"]
        lines.append(f"{k:<18}{v['sent']:>6}" + "".join(f"{st.get(c, 0):>{w[c]}}" for c in cols)
                     + f"{_ms(v['latency_median_s']):>9}{_ms(v['latency_p99_s']):>9}{_ms(v['ttft_median_s']):>8}")
    echo, ow, cons = report["canary_echo"], report["over_window"], report["consistency"]
    lines += ["",
              f"cross-request leaks:   {report['leaks']}",
              (f"canary echo rate:      {_pct(echo['rate'])} ({echo['echoed_own_secret']} of "
               f"{echo['answered']} answered canaries repeated their own secret)"),
              f"over-window prompts:   {ow['sent']} sent: "
              + (", ".join(f"{n}x {k}" for k, n in sorted(ow["results"].items())) or "-"),
              f"in-window rejected:    {report['in_window_rejected']['count']}",
              (f"consistency:           {cons['differing']} of {cons['compared']} greedy prompts answered "
               f"differently under load ({_pct(cons['rate'])}){' [strict]' if cons['strict'] else ''}")]
    if report["violations"]:
        lines += ["", "violations: " + ", ".join(f"{n}x {k}" for k, n in sorted(report["violation_counts"].items()))]
        for v in report["violations"][:20]:
            lines.append(f"  - #{v['request']} {v['endpoint']} {v['kind']}: {v['detail']}")
        if len(report["violations"]) > 20:
            lines.append(f"  ... {len(report['violations']) - 20} more in the JSON report")
    lines += [""] + [f"note: {n}" for n in report["notes"]]
    lines.append(f"verdict: {report['verdict']} (exit {report['exit_code']})")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
