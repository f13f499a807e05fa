"""Clients that leave: requests abandoned mid-way, to run beside an audit (scripts/audit_churn.sh).

Half are streamed and closed after their first content chunk; half are whole and given up after 0.2 to 3 s
(queued, prefilling or decoding by then). Reports what the server answered before each client left; the server
must free every page of every abandoned request (the audit script checks /info afterwards).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections import Counter

import httpx

from kvseal.bench.load.dataset import WORDS


async def one(client: httpx.AsyncClient, model: str, i: int, rng: random.Random) -> str:
    body = {"model": model, "max_tokens": rng.randint(16, 64), "temperature": 0.7, "ignore_eos": True,
            "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 150)))}]}
    if i % 2 == 0:
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return f"{r.status_code} before the stream"
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return "left after the first chunk"
            return "stream ended before the client left"
    try:
        r = await client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.2, 3.0))
    except httpx.TimeoutException:
        return "left before the answer"
    return f"{r.status_code} before the client left"


async def run(a: argparse.Namespace) -> Counter[str]:
    rng = random.Random(a.seed)
    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(base_url=a.url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def guarded(i: int, start: float) -> str:
            await asyncio.sleep(start)
            async with sem:
                try:
                    return await one(client, model, i, random.Random(a.seed * 100_003 + i))
                except httpx.HTTPError as exc:
                    return f"transport error {type(exc).__name__}"

        starts = [rng.uniform(0, a.spread) for _ in range(a.requests)]
        return Counter(await asyncio.gather(*(guarded(i, s) for i, s in enumerate(starts))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--spread", type=float, default=5.0, help="each request starts at a random time within this many seconds")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(json.dumps(dict(asyncio.run(run(a))), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
