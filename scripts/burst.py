"""A burst of concurrent mixed chats against any OpenAI-compatible server, as issue 10's finding 4 tried it.

    .venv/bin/python scripts/burst.py http://127.0.0.1:8000 --chats 200 --json burst.json

A third of the chats carry 100 to 1,500 words, a tenth are over the window (--window, default 8,192 tokens; they
must get 400 context_length_exceeded), the rest are short questions. All are sent at once with the official
openai client. Reports the statuses and codes of in-window and over-window chats, the time to the last answer,
and, for a kvseal server, whether every worker's pool is back at baseline. Exit 0 when no in-window chat
failed and every over-window chat got 400.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from typing import Any

import httpx
import openai

from kvseal.bench.load.dataset import WORDS


def chats(n: int, window: int, seed: int) -> list[tuple[str, bool]]:
    """(user message, over the window?) for n chats."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 10 == 0:
            words, over = int(window * 1.1), True  # a word is at least one token: over the window
        elif i % 3 == 0:
            words, over = rng.randint(100, 1500), False
        else:
            words, over = rng.randint(5, 40), False
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append((f"Summarize in one sentence: {text}", over))
    rng.shuffle(out)
    return out


async def one(client: openai.AsyncOpenAI, model: str, text: str, max_tokens: int) -> tuple[int, str]:
    try:
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                 max_tokens=max_tokens, temperature=0)
    except openai.APIStatusError as e:
        return e.status_code, str(e.code)
    except openai.APIError as e:  # no HTTP answer at all: a connection reset or a timeout
        return 0, type(e).__name__
    return 200, str(r.choices[0].finish_reason)


async def run(a: argparse.Namespace) -> dict[str, Any]:
    client = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0, timeout=a.timeout,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=a.chats + 10),
                                                              timeout=a.timeout))
    model = (await client.models.list()).data[0].id
    todo = chats(a.chats, a.window, a.seed)
    started = time.monotonic()
    results = await asyncio.gather(*(one(client, model, text, a.max_tokens) for text, _ in todo))
    elapsed = time.monotonic() - started
    inside = Counter(f"{s} {c}" for (s, c), (_, over) in zip(results, todo) if not over)
    over = Counter(f"{s} {c}" for (s, c), (_, o) in zip(results, todo) if o)
    report: dict[str, Any] = {"chats": a.chats, "seconds": round(elapsed, 1), "in_window": dict(inside),
                              "over_window": dict(over),
                              "in_window_errors": sum(n for k, n in inside.items() if not k.startswith("200")),
                              "over_window_not_400": sum(n for k, n in over.items() if not k.startswith("400"))}
    info = httpx.get(a.url + "/info", timeout=30).json()
    workers = info.get("workers", [info])
    report["pools_at_baseline"] = all(w.get("free_pages") == w.get("pool_pages") for w in workers)
    report["ended"] = info.get("ended")
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--chats", type=int, default=200)
    p.add_argument("--window", type=int, default=8192, help="the server's context window (tokens)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--timeout", type=float, default=3600.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here too")
    a = p.parse_args()
    report = asyncio.run(run(a))
    text = json.dumps(report, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if report["in_window_errors"] == 0 and report["over_window_not_400"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
