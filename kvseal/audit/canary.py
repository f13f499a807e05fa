"""Canaries for the leak audit: secrets, the prompts that carry them, the request plan, and leak detection.

Everything here is pure (no I/O): given the same seed it builds the same secrets and prompts, so a report
can be replayed. A secret is 8 characters of upper-case letters and digits (no 0/O, 1/I/L), with at least
two of each, so it splits into several tokens in any BPE vocabulary and cannot occur in the filler text.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any, Literal

SECRET_LEN = 8
ALPHABET_LETTERS = "ABCDEFGHJKMNPQRSTUVWXYZ"
ALPHABET_DIGITS = "23456789"
CHAT_OVERHEAD_TOKENS = 64  # chat template and instruction, counted on top of the estimated prompt
_NON_ALNUM = re.compile(r"[^A-Za-z0-9]+")

Endpoint = Literal["chat", "completion"]

_SENTENCES = (
    "The river ran slowly past the old mill and the children watched the boats go by.",
    "In spring the orchard was full of blossom and the bees worked from dawn until dusk.",
    "A quiet library keeps its books in long rows, each one waiting for a reader.",
    "The train left the station on time and crossed the valley before noon.",
    "Our team met on Tuesday to review the schedule and agree on the next steps.",
    "Fresh bread, a little butter and a cup of tea make a simple breakfast.",
    "The mountain path was steep, but the view from the top was worth the climb.",
    "Rain fell all afternoon, and the streets shone under the evening lamps.",
    "She wrote the report carefully, checking every number twice before sending it.",
    "The museum opened a new room for maps drawn by sailors centuries ago.",
    "Every winter the lake froze over and the village held a market on the ice.",
    "He planted tomatoes, beans and sunflowers along the south wall of the garden.",
)


def make_secret(rng: random.Random) -> str:
    """One secret: 8 characters, at least two letters and two digits, never all-letter or all-digit."""
    while True:
        s = "".join(rng.choice(ALPHABET_LETTERS + ALPHABET_DIGITS) for _ in range(SECRET_LEN))
        letters = sum(c in ALPHABET_LETTERS for c in s)
        if 2 <= letters <= SECRET_LEN - 2:
            return s


def make_secrets(n: int, rng: random.Random) -> list[str]:
    """`n` distinct secrets."""
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        s = make_secret(rng)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def normalize(text: str) -> str:
    """Letters and digits only: a secret split by spaces, dashes or newlines still matches."""
    return _NON_ALNUM.sub("", text)


def contains_secret(text: str, secret: str) -> bool:
    return secret in normalize(text)


def find_secrets(text: str, secrets: set[str] | frozenset[str]) -> list[str]:
    """Every issued secret found in `text` (in order of first appearance). Linear in len(text)."""
    norm = normalize(text)
    found: list[str] = []
    for i in range(len(norm) - SECRET_LEN + 1):
        w = norm[i:i + SECRET_LEN]
        if w in secrets and w not in found:
            found.append(w)
    return found


def find_foreign_secrets(text: str, own: str | None, secrets: set[str] | frozenset[str]) -> list[str]:
    """Secrets of OTHER requests found in `text`: each one is a cross-request leak."""
    return [s for s in find_secrets(text, secrets) if s != own]


def snippet(text: str, needle: str, width: int = 60) -> str:
    """The text around `needle` (or the start of the text if it only matches after normalization)."""
    i = text.find(needle)
    if i < 0:
        return text[: 2 * width]
    return text[max(0, i - width): i + len(needle) + width]


def filler(n_chars: int, secret: str | None, rng: random.Random) -> str:
    """About `n_chars` of plain prose; the secret recurs every ~500 characters, so every KV page that holds
    this prompt also holds its secret, and a stale page read by another request gives itself away."""
    parts: list[str] = []
    size = since = 0
    while size < n_chars:
        if secret is not None and since >= 500:
            s = f"Reference code {secret}."
            since = 0
        else:
            s = rng.choice(_SENTENCES)
        parts.append(s)
        size += len(s) + 1
        since += len(s) + 1
    return " ".join(parts)[:n_chars]


def completion_prompt(secret: str, pad: str) -> str:
    """A pattern that a base or instruct model continues with the secret under greedy decoding."""
    lines = "".join(f"code: {secret}\n" for _ in range(4))
    return (pad + "\n\n" if pad else "") + lines + "code:"


def chat_messages(secret: str, pad: str) -> list[dict[str, str]]:
    """A short exchange in which the assistant already repeated the secret once: even a 135M instruct model
    then repeats it after thousands of tokens of filler (a single user turn makes it continue the filler)."""
    return [{"role": "user", "content": (pad + "\n\n" if pad else "") + f"Repeat exactly: {secret}"},
            {"role": "assistant", "content": secret},
            {"role": "user", "content": f"Repeat exactly: {secret} {secret} {secret}"}]


def consistency_prompt(k: int) -> tuple[Endpoint, str]:
    """The k-th fixed greedy prompt (no secret): alternately a completion and a chat prompt."""
    subjects = ("colors", "fruits", "animals", "countries", "planets", "tools", "rivers", "trees")
    if k % 2 == 0:
        return "completion", f"Count from {k + 1} to {k + 8}: {k + 1}, {k + 2},"
    return "chat", f"Name three {subjects[(k // 2) % len(subjects)]}. Answer in one short line."


def error_problem(body: Any) -> str | None:
    """None when `body` is a well-formed OpenAI error ({"error": {"message": str, "type": str, ...}}),
    else what is wrong with it."""
    if not isinstance(body, dict):
        return f"error body is not a JSON object ({type(body).__name__})"
    err = body.get("error")
    if not isinstance(err, dict):
        return "error body has no 'error' object"
    if not isinstance(err.get("message"), str) or not err["message"]:
        return "error.message is missing or not a non-empty string"
    if not isinstance(err.get("type"), str) or not err["type"]:
        return "error.type is missing or not a non-empty string"
    return None


@dataclass(frozen=True)
class RequestSpec:
    """One planned request. The prompt itself is built lazily (near-window prompts can be megabytes)."""

    index: int
    endpoint: Endpoint
    stream: bool
    secret: str | None  # None for consistency prompts
    target_tokens: int  # estimated prompt tokens (0 for consistency prompts)
    over_window: bool = False
    consistency: int | None = None  # which fixed prompt
    phase: Literal["solo", "load"] = "load"


@dataclass(frozen=True)
class Sizing:
    """How prompt text maps to tokens: `fit_cpt` is used for in-window prompts (small: overestimates tokens,
    so they fit), `over_cpt` for over-window prompts (large: underestimates, so they truly exceed)."""

    window: int
    max_tokens: int
    fit_cpt: float
    over_cpt: float

    @property
    def usable(self) -> int:
        """Prompt tokens an in-window request may use, leaving room for the answer and the chat template."""
        return max(self.window - self.max_tokens - CHAT_OVERHEAD_TOKENS, 8)

    def chars_for(self, spec: RequestSpec) -> int:
        cpt = self.over_cpt if spec.over_window else self.fit_cpt
        return max(int(spec.target_tokens * cpt), 0)


def sizing_from_calibration(window: int, max_tokens: int, cpt: float | None) -> Sizing:
    """Margins around a measured characters-per-token ratio, or blind conservative ones without it."""
    if cpt is None:
        return Sizing(window, max_tokens, fit_cpt=2.0, over_cpt=8.0)
    cpt = min(max(cpt, 1.0), 10.0)
    return Sizing(window, max_tokens, fit_cpt=cpt * 0.95, over_cpt=cpt * 1.25)


def plan_lengths(n: int, usable: int, rng: random.Random) -> list[int]:
    """Estimated prompt tokens for `n` in-window requests: about a third short, 40 % spread log-uniformly,
    a quarter close to the window (80-97 % of `usable`)."""
    lo = min(16, usable)
    short_hi = max(min(256, usable // 4), lo)
    out: list[int] = []
    for i in range(n):
        band = i % 20
        if band < 7:
            t = rng.randint(lo, short_hi)
        elif band < 15:
            a, b = math.log(max(short_hi, 1)), math.log(max(int(usable * 0.75), short_hi, 1))
            t = int(math.exp(rng.uniform(a, b)))
        else:
            t = int(usable * rng.uniform(0.8, 0.97))
        out.append(max(min(t, usable), 1))
    return out


def build_plan(n_requests: int, n_over: int, n_consistency: int, window: int, max_tokens: int,
               stream: bool, rng: random.Random) -> tuple[list[RequestSpec], list[RequestSpec]]:
    """(solo consistency requests, load requests). Load order is shuffled; the consistency repeats are spread
    through it and the over-window prompts sit in its second part, after many pages have been used."""
    usable = Sizing(window, max_tokens, 1.0, 1.0).usable
    secrets = make_secrets(n_requests + n_over, rng)
    lengths = plan_lengths(n_requests, usable, rng)
    kinds: list[tuple[Endpoint, bool]] = [("completion", False), ("chat", False), ("completion", True),
                                          ("chat", True)]
    if not stream:
        kinds = [k for k in kinds if not k[1]]
    body: list[RequestSpec] = []
    for i in range(n_requests):
        ep, st = kinds[i % len(kinds)]
        body.append(RequestSpec(0, ep, st, secrets[i], lengths[i]))
    rng.shuffle(body)
    factors = (1.3, 2.0)
    for j in range(n_over):
        ep, st = kinds[j % len(kinds)]
        spec = RequestSpec(0, ep, st, secrets[n_requests + j], math.ceil(window * factors[j % 2]),
                           over_window=True)
        pos = len(body) * 2 // 5 + (len(body) * 3 // 5) * j // max(n_over, 1)
        body.insert(min(pos, len(body)), spec)
    solo: list[RequestSpec] = []
    for k in range(n_consistency):
        ep, _ = consistency_prompt(k)
        # every other fixed prompt is long (90% of the usable window): a server that treats long prompts
        # differently under load (placeholders, stale pages) answers them differently alone and under load
        target = int(usable * 0.9) if k % 2 else 0
        solo.append(RequestSpec(0, ep, False, None, target, consistency=k, phase="solo"))
        again = RequestSpec(0, ep, False, None, target, consistency=k, phase="load")
        body.insert(min(len(body) * (2 * k + 1) // (2 * n_consistency), len(body)), again)
    numbered_solo = [_renumber(s, i) for i, s in enumerate(solo)]
    numbered_load = [_renumber(s, len(solo) + i) for i, s in enumerate(body)]
    return numbered_solo, numbered_load


def _renumber(spec: RequestSpec, index: int) -> RequestSpec:
    return RequestSpec(index, spec.endpoint, spec.stream, spec.secret, spec.target_tokens, spec.over_window,
                       spec.consistency, spec.phase)


def request_body(spec: RequestSpec, sizing: Sizing, model: str, seed: int) -> dict[str, Any]:
    """The JSON body for `spec` (greedy, max_tokens from `sizing`)."""
    body: dict[str, Any] = {"model": model, "max_tokens": sizing.max_tokens, "temperature": 0,
                            "stream": spec.stream}
    if spec.consistency is not None:
        ep, text = consistency_prompt(spec.consistency)
        if spec.target_tokens:  # a long fixed prompt: the same filler every time (seeded by its number)
            text = filler(sizing.chars_for(spec), None, random.Random(f"consistency:{spec.consistency}")) + \
                "\n\n" + text
        if ep == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        return body
    assert spec.secret is not None
    pad = filler(sizing.chars_for(spec), spec.secret, random.Random(f"{seed}:{spec.index}"))
    if spec.endpoint == "chat":
        body["messages"] = chat_messages(spec.secret, pad)
    else:
        body["prompt"] = completion_prompt(spec.secret, pad)
    return body
