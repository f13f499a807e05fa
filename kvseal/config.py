"""Frozen configuration, one dataclass per concern, validated on construction.

Every error names the field, the value and the fix. Nothing mutates a config after it is built. A field that is a
command-line flag says so in its metadata (`opt`): its help text, and its flag name where that is not the field's
own; kvseal/config_args.py builds the flags from them, and `kvseal.LLM(**options)` takes the same fields by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


def opt(default: Any, help: str | None, flag: str | None = None, **argparse: Any) -> Any:
    """A config field that is a command-line flag: `help` is its --help text, `flag` its name (default
    --field-name; "model" for a positional), `argparse` anything else add_argument takes (choices, metavar, action).
    """
    return field(default=default, metadata={"cli": {"help": help, "flag": flag, **argparse}})


def _need(cond: bool, field: str, value: object, fix: str) -> None:
    if not cond:
        raise ValueError(f"invalid {field}={value!r}: {fix}")


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = opt(None, "a .gguf file or a Hugging Face folder (Llama/Qwen2); default: the bundled "
                                 "SmolLM2-135M-Instruct", flag="model")
    dtype: str = opt("float32", "the model's compute dtype for the exact arithmetic with --kernels torch (bfloat16 "
                     "is several times faster on AMX CPUs); the native kernels compute in float32", choices=_DTYPES)
    device: str = opt("auto", "auto (cuda when present, else cpu), cpu or cuda[:N]")
    max_model_len: int | None = opt(None, "cap the served context window (tokens); the window is min(model, this, "
                                    "pool)")
    served_name: str | None = opt(None, "the model id in the API (default: the checkpoint's name)",
                                  flag="--served-model-name")
    kernels: str = opt("auto", "native: kvseal's C kernels (GGUF blocks used as stored, paged decode attention; "
                       "CPU, AVX2); torch: torch ops on dequantized weights (matches transformers bit for bit in "
                       "float32); auto: native where it can run, else torch", choices=("auto", "torch", "native"))
    arithmetic: str = opt(
        "auto", "how the native kernels compute, chosen at start-up and named in /info, the start-up log and the "
        "fleet check. fast: int8 activations times the GGUF blocks with integer dot products on the best of "
        "AVX-512-VNNI, AVX-VNNI or AVX2 this CPU has (the same bits on each; float checkpoints become Q8_0 blocks "
        "at load), attention reading KV in place; batch invariant, about 0.5%% from float32 per product "
        "(agreement: python -m benchmarks.agreement). exact: float32 throughout, transformers' greedy tokens. auto "
        "(default): fast where it can run (native kernels, page size a multiple of 16), else exact "
        "(kvseal/kernels/arithmetic.py)", choices=("auto", "exact", "fast"))

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
    page_size: int = opt(16, "tokens per KV page")
    pool_tokens: int | None = opt(None, "KV pool size in tokens, rounded down to whole pages (default: twice the "
                                  "context window)", flag="--kv-pool-tokens")
    # or in bytes; at most one of the two; neither -> twice the model's window (min(model, max_model_len)), the
    # default Engine passes to kv/pool.pool_num_pages
    pool_bytes: int | None = opt(None, "KV pool size in bytes (instead of tokens)", flag="--kv-pool-bytes")
    scrub: bool = opt(True, "zero KV pages before they return to the free list (seal 6; default on)",
                      flag="--kv-scrub")
    kv_dtype: str = opt("auto", "KV cache dtype; auto: bfloat16 with the fast arithmetic (half the KV memory, "
                        "decode reads and handoff bytes), else the model's dtype. bfloat16 needs --arithmetic fast "
                        "or --kernels torch", choices=("auto", "float32", "bfloat16"))
    prefix_cache: bool = opt(True, "keep no prefix cache (by default full prompt pages are kept and shared "
                             "read-only with later requests of the same tenant and cache_salt; seal 9)",
                             flag="--no-prefix-cache", action="store_false", dest="prefix_cache")
    # sliding-window layers keep only their window of pages, in a pool of their own (kv/window.py; a unified engine
    # only). Such an engine keeps no prefix cache: off gives it back, every page kept for the whole context
    window_pages: bool = opt(True, "keep every KV page of sliding-window layers (Mistral, Gemma 3) for the whole "
                             "context; by default a unified worker keeps only their window, in a pool of their own, "
                             "and then keeps no prefix cache", flag="--no-window-pages", action="store_false",
                             dest="window_pages")

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
    max_num_seqs: int = opt(64, "most sequences in one batch")
    max_num_batched_tokens: int = opt(512, "per-step token budget; longer prompts are prefilled in chunks of this "
                                      "size")
    max_waiting: int = opt(1024, "requests that may wait for KV pages; beyond this, 503 with Retry-After")
    wait_timeout_s: float = opt(60.0, "a request waiting for KV pages gets 503 when no page at all was freed for "
                                "this many seconds (a busy worker that frees pages is waited out)",
                                flag="--wait-timeout")
    fairness: str = opt("vtc", "who each engine admits next when tenants compete: vtc (default; the tenant served "
                        "least, in tokens weighted by its weight from --api-keys, as the Virtual Token Counter; a "
                        "tenant alone gets everything; engine/fairness.py) or off (arrival order)",
                        choices=("vtc", "off"))
    # vtc: prompt tokens per step (chunks, recompute) while more than one tenant competes; a newcomer waits for one
    # such step, not a max_num_batched_tokens chunk of another tenant's prompt
    contended_chunk_tokens: int = opt(128, "with --fairness vtc: prompt tokens per step while more than one tenant "
                                      "competes (had work within 5 s), so that a newcomer waits for a short step; a "
                                      "tenant alone gets --max-num-batched-tokens chunks")
    speculative: str = opt("lookup", "speculative decoding (engine/drafts.py): lookup (default) drafts a request's "
                           "next tokens from n-grams of its own prompt and output, nothing else, and verifies them "
                           "in the batched step; greedy tokens are the same, sampled ones keep their distribution; "
                           "off: never. A request may say speculative: false", choices=("lookup", "off"))
    speculative_rows: int = opt(12, "with --speculative lookup: a step drafts only while nothing waits and no prompt "
                                "runs, and while its decode rows, drafts included, stay within this many (a small "
                                "batch reads every weight for a handful of rows; a large one is already "
                                "compute-bound)", metavar="N")

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
        _need(self.speculative in ("lookup", "off"), "speculative", self.speculative, "use lookup (drafts from the "
              "request's own text) or off")
        _need(2 <= self.speculative_rows <= self.max_num_batched_tokens, "speculative_rows", self.speculative_rows,
              f"give 2 to --max-num-batched-tokens ({self.max_num_batched_tokens}) rows")


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's share and limits, from its lines of the --api-keys file (tenancy/tenant_file.py).

    weight and priority_class travel to every worker with each request (never from the client); the limits are
    kept by the router (tenancy/limits.py). None: no limit."""

    weight: float = 1.0  # its share of every engine against the other backlogged tenants (VTC)
    priority_class: int = 0  # lower is served first, across tenants; within a class tenants share by weight
    max_concurrent: int | None = None  # requests in flight at once (every endpoint that does work)
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute: prompt + max_tokens charged at admission, unused output refunded
    kv_share: float = 1.0  # most of each engine's KV pages its requests may hold when one more is admitted
    store_mb: float = 64.0  # its stored responses (tenancy/response_store.py): its own partition, in MiB

    def __post_init__(self) -> None:
        _need(0 < self.weight <= 1e6, "weight", self.weight, "give a positive number (a share against other "
              "tenants: weight=3 gets three times a weight=1 tenant's tokens while both are busy)")
        _need(-1000 <= self.priority_class <= 1000, "priority_class", self.priority_class,
              "give an integer from -1000 to 1000 (lower is served first; default 0)")
        for name in ("max_concurrent", "rpm", "tpm"):
            v = getattr(self, name)
            _need(v is None or 0 < v <= 2**31 - 1, name, v, "give a positive integer, or leave it out for no limit")
        _need(0 < self.kv_share <= 1, "kv_share", self.kv_share, "give a fraction of the KV pool in (0, 1]")
        _need(0 < self.store_mb <= 1e6, "store_mb", self.store_mb, "give the MiB its stored responses may hold, "
              "a positive number (default 64)")


@dataclass(frozen=True)
class ServerConfig:
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    max_body_bytes: int = opt(8 * 1024 * 1024, "larger request bodies get 413")
    tenant_body_bytes: int = opt(64 * 1024 * 1024, "request bodies one tenant may have in the router at once, "
                                 "summed over its requests in progress; past it, 429 (each tenant its own budget)")
    text_threads: int = opt(0, "threads that render chat templates and tokenize prompts, shared by the tenants "
                            "through a fair queue; 0: the CPUs, at least 2", metavar="N")
    text_threads_per_tenant: int = opt(0, "most of those threads one tenant's prompts may hold at once; 0: half "
                                       "of them (all of them on a server without --api-keys: one tenant)",
                                       metavar="N")
    state: str | None = opt(None, "where tenants' limits and stored responses live: this router's memory (default), "
                            "or redis://HOST:PORT/DB, shared by every router of the fleet (limits fail closed "
                            "when it is unreachable)", metavar="redis://HOST:PORT/DB")
    state_password_file: str | None = opt(None, "a file holding the Redis password (never on the command line)",
                                          metavar="FILE")
    state_secret_file: str | None = opt(None, "a file of at least 32 random bytes: the key that seals stored "
                                        "responses at rest (AES-GCM, a key per tenant) and hashes the tenant "
                                        "names in Redis; every router of the fleet reads the same one",
                                        metavar="FILE")
    state_lease_s: float = opt(30.0, "with --state: seconds a router's place for a request in flight lasts "
                               "unless renewed (a dead router's places free within it)", metavar="SECONDS")
    # (SHA-256 of a key, its tenant) from --api-keys; empty: no auth, one tenant. Digests only, never keys.
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)  # digests of the api keys marked `admin`
    tenants: tuple[tuple[str, TenantPolicy], ...] = ()  # the settings of each tenant that has any

    def __post_init__(self) -> None:
        _need(0 <= self.port < 65536, "port", self.port, "give a TCP port 0-65535")
        _need(all(len(d) == 64 and t for d, t in self.api_keys), "api_keys", f"{len(self.api_keys)} entries",
              "give (sha256 hex digest of a key, tenant name) pairs (kvseal.tenancy.tenants.load_api_keys)")
        _need(set(self.admin_keys) <= {d for d, _ in self.api_keys}, "admin_keys", f"{len(self.admin_keys)} entries",
              "mark keys of the --api-keys file as admin (a third word `admin` on their line)")
        _need({t for t, _ in self.tenants} <= {t for _, t in self.api_keys}, "tenants",
              f"{len(self.tenants)} entries", "give settings only to tenants that have a key in --api-keys")
        _need(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "give a positive size")
        _need(self.tenant_body_bytes >= self.max_body_bytes, "tenant_body_bytes", self.tenant_body_bytes,
              f"give at least --max-body-bytes ({self.max_body_bytes}): one whole request must fit")
        _need(self.state is None or self.state.startswith("redis://"), "state", self.state,
              "give redis://HOST:PORT/DB, or leave it out to keep tenant state in this router's memory")
        _need(self.state is None or self.state_secret_file is not None, "state_secret_file", None,
              "with --state, give --state-secret-file FILE (the same on every router): stored responses are sealed "
              "with it")
        _need(1.0 <= self.state_lease_s <= 3600, "state_lease_s", self.state_lease_s, "give 1 to 3600 seconds")
        _need(0 <= self.text_threads <= 256, "text_threads", self.text_threads, "give 0 (auto) to 256 threads")
        _need(0 <= self.text_threads_per_tenant <= self.text_pool_threads, "text_threads_per_tenant",
              self.text_threads_per_tenant, f"give 0 (auto) to --text-threads ({self.text_pool_threads})")

    @property
    def text_pool_threads(self) -> int:
        return self.text_threads or max(2, os.cpu_count() or 1)

    @property
    def text_threads_each(self) -> int:
        """The per-tenant cap of the text pool: with one tenant (no keys) it may use every thread."""
        if self.text_threads_per_tenant:
            return self.text_threads_per_tenant
        return self.text_pool_threads if not self.api_keys else max(1, self.text_pool_threads // 2)


@dataclass(frozen=True)
class LedgerConfig:
    path: str | None = opt(None, "the forensic ledger: an SQLite file with one row per ended request (ids, tenant, "
                           "times, workers, every page read and whose KV it held; never prompt or output text), "
                           "read by `kvseal incidents PATH`. kvseal serve: on by default (the path is shown); a "
                           "role run alone: off unless given", flag="--ledger", metavar="PATH|off")

    def __post_init__(self) -> None:
        _need(self.path is None or (bool(self.path.strip()) and not os.path.isdir(self.path)), "ledger",
              self.path, "give the path of a file (it is created with its folder), or off")


@dataclass(frozen=True)
class GrammarConfig:
    """response_format grammars (engine/structured.py): compiled off the engine's loop, in child processes."""

    # a compile takes a core; the engine's steps, at a higher priority, come first
    grammar_compilers: int = opt(0, "processes that compile response_format grammars, off the engine's loop "
                                 "(started on the first constrained request, idle unless compiling, at a lower CPU "
                                 "priority than the engine); 0: one per two cores, at most 2", metavar="N")
    grammar_timeout_s: float = opt(30.0, "seconds a response_format grammar may take to compile; past it its "
                                   "process is killed and replaced, and the request gets 400 (param "
                                   "response_format)", flag="--grammar-timeout")
    grammar_max_bytes: int = opt(64 * 1024, "a response_format schema larger than this is refused with 400 before "
                                 "anything compiles")

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
    seed: int = opt(0, "seed for requests that sample without their own seed")
    ledger: LedgerConfig = LedgerConfig()
    grammar: GrammarConfig = GrammarConfig()
