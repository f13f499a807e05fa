"""When each request of a pass is sent: a seeded Poisson process (exponential gaps), or all at once."""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds after the pass starts at which each of n requests is sent, non-decreasing. The first goes at 0;
    the gaps after it are exponential with mean 1/rate. rate = inf: every request at 0."""
    if math.isinf(rate):
        return [0.0] * n
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out
