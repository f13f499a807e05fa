"""Structured output (`response_format`): constrained decoding with xgrammar, as vLLM and SGLang do it.

Before each sampling step the logits of a constrained row are masked to the tokens its grammar allows next (a
packed bitmask, (B, ceil(V/32)) int32), so greedy or sampled, every token keeps the output a valid prefix of the
grammar; once the grammar is complete only a stop token is allowed and the request ends FINISHED(stop). Logprobs
are not masked: they come from the model's own distribution (engine/sampling.py), as vLLM reports them.

Grammars compile off the engine's loop, in a pool of compiler processes (engine/grammar_pool.py) with a size and a
time limit, so a tenant's slow schema never stalls the others' steps. Compiled grammars are cached per tenant: an
LRU keyed (tenant, format), and one tenant's request never waits on, or is served from, another tenant's entry
(seal 9: no shared cache, not even one whose timing would tell that someone sent the same schema). xgrammar is
imported, and the pool started, on the first constrained request: a server that never sees one never pays it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from kvseal.config import GrammarConfig
from kvseal.engine.grammar_compiler import CompileJob, CompilerInit
from kvseal.engine.grammar_pool import GrammarPool
from kvseal.errors import InvalidRequest, KvsealError
from kvseal.model.tokenizer import Tokenizer
from kvseal.wire.messages import ResponseFormat

if TYPE_CHECKING:
    import torch
    import xgrammar

CACHE_ENTRIES = 64  # compiled grammars (and refusals) kept, over all tenants
_Key = tuple[str, ResponseFormat]


def check_format(fmt: ResponseFormat, max_bytes: int) -> None:
    """Raise InvalidRequest, naming the field, for a format no compile could enforce or that is too large to try."""
    if fmt.type not in ("json_object", "json_schema") or (fmt.type == "json_schema") != (fmt.schema is not None):
        raise InvalidRequest(f"response_format type {fmt.type!r} needs " +
                             ("a schema" if fmt.type == "json_schema" else "one of json_object or json_schema"),
                             param="response_format")
    size = len(fmt.schema.encode("utf-8", "surrogatepass")) if fmt.schema is not None else 0
    if size > max_bytes:
        raise InvalidRequest(f"response_format's schema is {size} bytes; this server compiles schemas of at most "
                             f"{max_bytes} bytes (--grammar-max-bytes)", param="response_format")


class Grammars:
    """Compiles response formats for one tokenizer and vocabulary width (the logits' V). Loop thread only."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cfg: GrammarConfig | None = None) -> None:
        self.tokenizer, self.vocab_size, self.cfg = tokenizer, vocab_size, cfg or GrammarConfig()
        self._info: xgrammar.TokenizerInfo | None = None
        self._pool: GrammarPool | None = None
        self._cache: OrderedDict[_Key, xgrammar.CompiledGrammar | KvsealError] = OrderedDict()
        self._jobs: dict[int, _Key] = {}  # job id -> what it compiles
        self._compiling: set[_Key] = set()
        self._transient: dict[_Key, KvsealError] = {}  # compiler faults of the last poll(), for its waiters only
        self._init: CompilerInit | None = None
        self._next_job = 1

    @property
    def busy(self) -> bool:
        """A compile is waiting or running: poll() must be called."""
        return self._pool is not None and self._pool.busy

    @property
    def pool(self) -> GrammarPool | None:
        return self._pool

    def compiled(self, tenant: str, fmt: ResponseFormat) -> xgrammar.CompiledGrammar | KvsealError | None:
        """The tenant's compiled grammar for fmt, or why it cannot be enforced; None while it compiles (a compile is
        started if none runs for this tenant and format). A format refused before compiling raises InvalidRequest."""
        check_format(fmt, self.cfg.grammar_max_bytes)
        key = (tenant, fmt)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        if key in self._transient:
            return self._transient[key]
        if key not in self._compiling:
            job_id, self._next_job = self._next_job, self._next_job + 1
            self._jobs[job_id] = key
            self._compiling.add(key)
            self._start_pool().submit(tenant, CompileJob(job_id, fmt.type, fmt.schema))
        return None

    def poll(self, wait: float = 0.0) -> bool:
        """Take in the compiles that ended (waiting up to `wait` s for one); True if any did."""
        if self._pool is None:
            return False
        import xgrammar as xgr

        self._transient.clear()
        done = self._pool.poll(wait)
        for job_id, outcome in done:
            key = self._jobs.pop(job_id)
            self._compiling.discard(key)
            if isinstance(outcome, str):
                self._cache[key] = xgr.CompiledGrammar.deserialize_json(outcome, self.tokenizer_info())
            elif isinstance(outcome, InvalidRequest):  # the format's own fault: the same again would fail again
                self._cache[key] = outcome
            else:  # a fault of the compiler, not of the format: this poll's waiters fail; a later request retries
                self._transient[key] = outcome
                continue
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return bool(done)

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> xgrammar.GrammarMatcher:
        """A fresh matcher for one sequence."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        if self._info is None:
            import xgrammar as xgr

            init = self.compiler_init()
            self._info = xgr.TokenizerInfo(init.vocab, xgr.VocabType(init.vocab_type), vocab_size=self.vocab_size,
                                           stop_token_ids=init.stop_ids, add_prefix_space=init.add_prefix_space)
        return self._info

    def compiler_init(self) -> CompilerInit:
        """What a compiler process needs to know of the vocabulary: V token texts, their encoding, the stops."""
        if self._init is not None:
            return self._init
        import xgrammar as xgr

        backend = self.tokenizer.backend
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        vocab = [""] * self.vocab_size
        for text, tid in backend.get_vocab(with_added_tokens=True).items():
            if tid < self.vocab_size:
                vocab[tid] = text
        self._init = CompilerInit(vocab, int(meta["vocab_type"].value), list(self.tokenizer.eos_ids),
                                  bool(meta["add_prefix_space"]))
        return self._init

    def _start_pool(self) -> GrammarPool:
        if self._pool is None:
            self._pool = GrammarPool(self.compiler_init(), self.cfg.compilers, self.cfg.grammar_timeout_s)
        return self._pool

    def mask(self, logits: torch.Tensor, matchers: list[xgrammar.GrammarMatcher | None]) -> None:
        """Mask, in place, the rows of logits (B, V) whose sequence has a matcher to what it allows next."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        import torch
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)  # (R, ceil(V/32)) int32
        for j, i in enumerate(rows):
            m = matchers[i]
            assert m is not None
            m.fill_next_token_bitmask(bitmask, j)
        with torch.inference_mode():  # the runner's logits are an inference tensor
            sub = logits[rows].float()
            xgr.apply_token_bitmask_inplace(sub, bitmask.to(sub.device))
            logits[rows] = sub.to(logits.dtype)
