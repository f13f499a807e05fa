"""Seeds of sampled tokens, the same on every process: a token's draw depends only on (request seed, its index).

The router gives each of a request's n samples its own seed stream (sample_seed); prefill and decode draw each
token from draw_seed(seed, index), so a seeded request gives the same output whichever worker samples which token.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed for output token `index` of a request seeded with `seed` (splitmix64).

    Each token's draw depends only on (seed, index), so the same seed gives the same output whatever else
    shares the batch, after a preemption, and whichever worker (prefill or decode) samples the token.
    """
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request with n samples: sample 0 keeps the request's seed (n=1 is
    unchanged), each other sample gets a stream of its own. No seed: each sample draws its own at the engine."""
    if seed is None or index == 0:
        return seed
    return draw_seed(seed ^ 0x5851F42D4C957F2D, -index - 1) - (1 << 62)  # a signed 63-bit value, like a seed
