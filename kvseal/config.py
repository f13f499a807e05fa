"""Frozen configuration, one dataclass per concern, validated on construction.

Every error names the field, the value and the fix. Nothing mutates a config after it is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPES = ("float32", "bfloat16", "float16")


def _need(cond: bool, field: str, value: object, fix: str) -> None:
    if not cond:
        raise ValueError(f"invalid {field}={value!r}: {fix}")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str = "auto"  # "auto" -> cuda when present, else cpu
    max_model_len: int | None = None  # cap on the served context window
    served_name: str | None = None  # the id in /v1/models; default: the checkpoint's name
    kernels: str = "auto"  # "torch" | "native" (kvseal/kernels) | "auto": native where it can run
    arithmetic: str = "auto"  # "exact" | "fast" | "auto": fast where it can run (kvseal/kernels/arithmetic.py)

    def __post_init__(self) -> None:
        _need(self.dtype in _DTYPES, "dtype", self.dtype, f"use one of {', '.join(_DTYPES)}")
        _need(self.device in ("auto", "cpu") or self.device.startswith("cuda"), "device", self.device,
              "use auto, cpu or cuda[:N]")
        _need(self.kernels in ("auto", "torch", "native"), "kernels", self.kernels, "use auto, torch or native")
        _need(self.arithmetic in ("auto", "exact", "fast"), "arithmetic", self.arithmetic, "use auto, exact or fast")
        _need(self.max_model_len is None or self.max_model_len > 0, "max_model_len", self.max_model_len,
              "give a positive number of tokens")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16  # tokens per page
    pool_tokens: int | None = None  # KV pool size in tokens (rounded down to whole pages)
    # or in bytes; at most one of the two; neither -> twice the model's window (min(model, max_model_len)), the
    # default Engine passes to kv/pool.pool_num_pages
    pool_bytes: int | None = None
    scrub: bool = True  # zero pages before they return to the free list (seal 6)
    kv_dtype: str = "auto"  # "auto": bfloat16 with the fast arithmetic, else the model's dtype (resolve_kv_dtype)
    prefix_cache: bool = True  # keep full prompt pages for later requests of the same tenant (seal 9)

    def __post_init__(self) -> None:
        _need(0 < self.page_size <= 1024 and self.page_size & (self.page_size - 1) == 0, "page_size",
              self.page_size, "give a power of two between 1 and 1024")
        _need(self.pool_tokens is None or self.pool_bytes is None, "pool_tokens/pool_bytes",
              (self.pool_tokens, self.pool_bytes), "set the pool in tokens or in bytes, not both")
        _need(self.pool_tokens is None or self.pool_tokens >= self.page_size, "pool_tokens",
              self.pool_tokens, f"give at least one page ({self.page_size} tokens)")
        _need(self.pool_bytes is None or self.pool_bytes > 0, "pool_bytes", self.pool_bytes,
              "give a positive number of bytes")
        _need(self.kv_dtype == "auto" or self.kv_dtype in _DTYPES, "kv_dtype", self.kv_dtype,
              f"use auto or one of {', '.join(_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one batch
    max_num_batched_tokens: int = 512  # per-step token budget; long prompts are prefilled in chunks
    max_waiting: int = 1024  # requests waiting for pages beyond this get 503 at once
    wait_timeout_s: float = 60.0  # 503 for a request waiting for pages when none was freed for this long
    fairness: str = "vtc"  # who is admitted next among tenants: "vtc" (engine/fairness.py) or "off" (arrival order)
    # vtc: prompt tokens per step (chunks, recompute) while more than one tenant competes; a newcomer waits for one
    # such step, not a max_num_batched_tokens chunk of another tenant's prompt
    contended_chunk_tokens: int = 128

    def __post_init__(self) -> None:
        _need(self.max_num_seqs > 0, "max_num_seqs", self.max_num_seqs, "give a positive number")
        _need(self.max_num_batched_tokens >= 16, "max_num_batched_tokens", self.max_num_batched_tokens,
              "give at least 16 tokens")
        _need(self.max_waiting > 0, "max_waiting", self.max_waiting, "give a positive number")
        _need(self.wait_timeout_s > 0, "wait_timeout_s", self.wait_timeout_s, "give a positive number")
        _need(self.contended_chunk_tokens >= 16, "contended_chunk_tokens", self.contended_chunk_tokens,
              "give at least 16 tokens (or the same as max_num_batched_tokens for no cap)")
        _need(self.fairness in ("vtc", "off"), "fairness", self.fairness, "use vtc (tenants share by weight) or off "
              "(arrival order)")


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's share and limits, from its lines of the --api-keys file (router/tenant_file.py).

    weight and priority_class travel to every worker with each request (never from the client); the limits are
    kept by the router (router/limits.py). None: no limit."""

    weight: float = 1.0  # its share of every engine against the other backlogged tenants (VTC)
    priority_class: int = 0  # lower is served first, across tenants; within a class tenants share by weight
    max_concurrent: int | None = None  # completion requests in flight at once
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute: prompt + max_tokens charged at admission, unused output refunded
    kv_share: float = 1.0  # most of each engine's KV pages its requests may hold when one more is admitted

    def __post_init__(self) -> None:
        _need(0 < self.weight <= 1e6, "weight", self.weight, "give a positive number (a share against other "
              "tenants: weight=3 gets three times a weight=1 tenant's tokens while both are busy)")
        _need(-1000 <= self.priority_class <= 1000, "priority_class", self.priority_class,
              "give an integer from -1000 to 1000 (lower is served first; default 0)")
        for name in ("max_concurrent", "rpm", "tpm"):
            v = getattr(self, name)
            _need(v is None or 0 < v <= 2**31 - 1, name, v, "give a positive integer, or leave it out for no limit")
        _need(0 < self.kv_share <= 1, "kv_share", self.kv_share, "give a fraction of the KV pool in (0, 1]")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    # (SHA-256 of a key, its tenant) from --api-keys; empty: no auth, one tenant. Digests only, never keys.
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)  # digests of the api keys marked `admin`
    tenants: tuple[tuple[str, TenantPolicy], ...] = ()  # the settings of each tenant that has any

    def __post_init__(self) -> None:
        _need(0 <= self.port < 65536, "port", self.port, "give a TCP port 0-65535")
        _need(all(len(d) == 64 and t for d, t in self.api_keys), "api_keys", f"{len(self.api_keys)} entries",
              "give (sha256 hex digest of a key, tenant name) pairs (kvseal.router.tenants.load_api_keys)")
        _need(set(self.admin_keys) <= {d for d, _ in self.api_keys}, "admin_keys", f"{len(self.admin_keys)} entries",
              "mark keys of the --api-keys file as admin (a third word `admin` on their line)")
        _need({t for t, _ in self.tenants} <= {t for _, t in self.api_keys}, "tenants",
              f"{len(self.tenants)} entries", "give settings only to tenants that have a key in --api-keys")
        _need(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "give a positive size")


@dataclass(frozen=True)
class LedgerConfig:
    path: str | None = None  # the forensic ledger's SQLite file (kvseal/ledger); None: no ledger

    def __post_init__(self) -> None:
        _need(self.path is None or (bool(self.path.strip()) and not os.path.isdir(self.path)), "ledger",
              self.path, "give the path of a file (it is created with its folder), or off")


@dataclass(frozen=True)
class GrammarConfig:
    """response_format grammars (engine/structured.py): compiled off the engine's loop, in child processes."""

    # compiler processes, started on the first constrained request and idle unless compiling; 0: auto, one per two
    # cores, at most 2 (a compile takes a core; the engine's steps, at a higher priority, come first)
    grammar_compilers: int = 0
    grammar_timeout_s: float = 30.0  # a compile past this kills its process; the request gets 400 response_format
    grammar_max_bytes: int = 64 * 1024  # a larger schema gets 400 response_format before anything compiles

    def __post_init__(self) -> None:
        _need(0 <= self.grammar_compilers <= 64, "grammar_compilers", self.grammar_compilers,
              "give 0 (auto: one per two cores, at most 2) to 64 processes")
        _need(self.grammar_timeout_s > 0, "grammar_timeout_s", self.grammar_timeout_s, "give a positive number of "
              "seconds")
        _need(self.grammar_max_bytes > 0, "grammar_max_bytes", self.grammar_max_bytes, "give a positive size")

    @property
    def compilers(self) -> int:
        return self.grammar_compilers or min(2, max(1, (os.cpu_count() or 1) // 2))


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    seed: int = 0
    ledger: LedgerConfig = LedgerConfig()
    grammar: GrammarConfig = GrammarConfig()
