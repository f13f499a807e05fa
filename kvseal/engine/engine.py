"""The engine: requests in, token deltas out, one step at a time. Single-threaded by design.

Every request that enters through add_request() leaves through exactly one final GenerateDelta (seal 1),
emitted only after its pages were scrubbed and freed (seals 6 and 8).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Pages
from functools import partial

import msgspec
import torch

from kvseal.config import EngineConfig
from kvseal.engine.messages import SCHEMA_VERSION, GenerateDelta, GenerateRequest, TokenLogprob
from kvseal.engine.params import check_sampling
from kvseal.engine.runner import ModelRunner
from kvseal.engine.sampling import sample
from kvseal.engine.scheduler import Scheduler
from kvseal.engine.sequence import Sequence
from kvseal.engine.structured import Grammars
from kvseal.errors import (
    ContextLengthExceeded,
    InternalError,
    InvalidRequest,
    KvsealError,
    Overloaded,
    PageOwnershipViolation,
    RequestAborted,
)
from kvseal.kernels.arithmetic import resolve_arithmetic
from kvseal.kernels.build import resolve as resolve_kernels
from kvseal.kernels.memory import keep_freed_pages
from kvseal.kv.allocator import PageAllocator, pages_for
from kvseal.kv.pool import KVPool, pool_num_pages
from kvseal.kv.prefix_cache import PrefixCache, namespace_id, namespace_root, page_keys
from kvseal.kv.spec import KVSpec
from kvseal.kv.window import WindowPages, split_pages, split_window
from kvseal.ledger.forensics import Forensics
from kvseal.ledger.store import Ledger
from kvseal.lifecycle import FinishReason, State
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.detokenize import IncrementalDecoder
from kvseal.model.llama import LlamaModel
from kvseal.model.loader import load_checkpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

log = logging.getLogger("kvseal.engine")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_kv_dtype(kv_dtype: str, model_dtype: str, fast: bool) -> str:
    """--kv-dtype auto: bfloat16 under the fast arithmetic (its attention reads bfloat16 pages in place: half the
    bytes per decode step and per handoff, as vLLM's bf16 KV; docs/benchmarks.md has the cost in perplexity),
    otherwise the model's dtype (the exact arithmetic keeps float32 KV for its bit-for-bit reference)."""
    if kv_dtype != "auto":
        return kv_dtype
    return "bfloat16" if fast else model_dtype


class Engine:
    def __init__(self, cfg: EngineConfig, ckpt: Checkpoint | None = None, role: str = "unified") -> None:
        self.cfg, self.role = cfg, role
        keep_freed_pages()
        ckpt = ckpt if ckpt is not None else load_checkpoint(cfg.model.path)
        self.ckpt_name, self.fingerprint, self.tokenizer = ckpt.name, ckpt.fingerprint, ckpt.tokenizer
        self.arch = arch = ckpt.arch
        self.device = resolve_device(cfg.model.device)
        self.dtype = _DTYPES[cfg.model.dtype]
        self.kernels, why = resolve_kernels(cfg.model.kernels, self.device.type, cfg.model.dtype, arch)
        # the window the model supports and the operator allows (the pool may hold less: context_window)
        self.model_window = model_window = min(arch.max_position, cfg.model.max_model_len or arch.max_position)
        self.arithmetic = resolve_arithmetic(cfg.model.arithmetic, self.kernels, why, arch, cfg.cache.page_size,
                                             ckpt.block_types())
        log.info("arithmetic: %s%s (%s)", self.arithmetic.name,
                 f" on {self.arithmetic.isa}" if self.arithmetic.isa else "", self.arithmetic.why)
        self.kv_dtype = _DTYPES[resolve_kv_dtype(cfg.cache.kv_dtype, cfg.model.dtype, self.arithmetic.fast)]
        if self.kv_dtype != self.dtype and not self.arithmetic.fast and self.kernels == "native":
            raise ValueError(f"--kv-dtype {cfg.cache.kv_dtype} with --dtype {cfg.model.dtype} needs the fast "
                             "arithmetic or --kernels torch (the exact native kernels read float32 KV). Fix: "
                             "--arithmetic fast, or drop --kv-dtype")
        self.model = LlamaModel(ckpt, self.dtype, self.device, native=self.kernels == "native",
                                fast=self.arithmetic.fast, max_model_len=model_window)
        num_pages = pool_num_pages(arch, cfg.cache, self.kv_dtype, default_tokens=2 * model_window)
        self.pages_scrubbed = 0  # seal 6, for /info and /metrics
        # sliding-window layers in a pool of their own that keeps only each sequence's window (kv/window.py);
        # a unified engine only: a handoff moves a page as every layer's KV
        self.window: WindowPages | None = None
        ps = cfg.cache.page_size
        layout = "kt" if self.arithmetic.fast else "std"
        if role == "unified" and cfg.cache.window_pages and split_window(self.model.windows):
            sched, windowed = cfg.scheduler, sum(1 for w in self.model.windows if w)
            num_pages, wpages = split_pages(num_pages, arch.num_layers - windowed, windowed,
                                            split_window(self.model.windows), ps, sched.max_num_seqs,
                                            sched.max_num_batched_tokens,
                                            sched.max_num_seqs * pages_for(model_window, ps))
            self.window = WindowPages(arch, self.model.windows, wpages, ps, self.kv_dtype, self.device,
                                      scrub=self._count_scrubbed if cfg.cache.scrub else None, layout=layout)
        self.pool = KVPool(arch, num_pages, ps, self.kv_dtype, self.device, layout=layout,
                           num_layers=None if self.window is None else len(self.window.full_layers))
        self.forensics: Forensics | None = None
        self.ownership_violations = 0  # seal 5 failures
        self.allocator = PageAllocator(num_pages, scrubber=self._scrub if cfg.cache.scrub else None)
        self.ledger = Ledger(cfg.ledger.path) if cfg.ledger.path else None
        if self.ledger is not None:
            self.forensics = Forensics(self.ledger, self.allocator, cfg.cache.page_size, role)
        # decode workers keep no prefix cache: prefill computes every prompt (see docs/architecture.md); nor does an
        # engine whose sliding layers drop their pages: a cached prefix would need their last window too
        self.prefix_cache = PrefixCache(self.allocator, enabled=cfg.cache.prefix_cache and role != "decode"
                                        and self.window is None)
        self.kv_layout = self.pool.layout_name
        # what this engine's KV is: a reservation, a manifest and the fleet check carry it (kv/spec.py)
        self.kv_spec = KVSpec(model_fingerprint=self.fingerprint, page_size=self.pool.page_size,
                              kv_dtype=str(self.kv_dtype).removeprefix("torch."), kv_layout=self.kv_layout)
        # The served window: what the model supports, the operator allows, and the pool can hold.
        self.context_window = min(model_window, self.pool.capacity_tokens)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, cfg.cache.page_size, self.prefix_cache, self.window)
        self.runner = ModelRunner(self.model, self.pool, self.allocator, self.window)
        self.grammars = Grammars(self.tokenizer, arch.vocab_size, cfg.grammar)  # response_format (structured.py)
        self.seqs: dict[str, Sequence] = {}
        # admitted, holding no pages (decode: verified, holding its KV), waiting for their grammar to compile:
        # request id -> (seq, what to do with it once its matcher is set). Outside the scheduler: the batch keeps
        # stepping meanwhile
        self.compiling: dict[str, tuple[Sequence, Callable[[], None]]] = {}
        self._out: list[GenerateDelta] = []
        self._rng = torch.Generator().manual_seed(cfg.seed)
        # (threads for small steps, threads for steps of at least `big` tokens, big): an engine that shares its
        # process with the HTTP server leaves it a core on decode steps and takes them all for prompt chunks
        self.step_threads: tuple[int, int, int] | None = None
        self._threads_now = 0

    def _scrub(self, pages: Pages[int]) -> None:
        self.pool.scrub(pages)
        self.pages_scrubbed += len(pages)
        if self.forensics is not None:
            self.forensics.scrubbed(pages)

    def _count_scrubbed(self, pages: Pages[int]) -> None:  # the window pool's pages (it zeroed them itself)
        self.pages_scrubbed += len(pages)

    # -- what this engine is -------------------------------------------------------------------------
    def info(self) -> dict[str, object]:
        """What this engine is, then its figures (a unified worker's /info; a disaggregated worker's identity is
        its WorkerCard, worker/card.py)."""
        return {
            "role": self.role,
            "model": self.ckpt_name,
            **self.kv_spec.fields(),  # model_fingerprint, page_size, kv_dtype, kv_layout
            "context_window": self.context_window,
            "model_max_position": self.arch.max_position,
            "pool_tokens": self.pool.capacity_tokens,
            "pool_pages": self.pool.num_pages,
            "prefix_cache": self.prefix_cache.enabled,
            "kernels": self.kernels,
            "arithmetic": self.arithmetic.name,
            "arithmetic_isa": self.arithmetic.isa or None,
            "kv_bytes_per_token": self.pool.bytes_per_token,
            "kv_scrub": self.cfg.cache.scrub,
            "device": str(self.device),
            "fairness": self.cfg.scheduler.fairness,
            "ledger": None if self.ledger is None else str(self.ledger.path),
            **self.figures(),
        }

    def figures(self) -> dict[str, object]:
        """What changes from one step to the next: pages, requests, tenants, counters. For display (/info, kvseal
        doctor, tests); no check reads them."""
        return {
            # free_pages: what a new request can get now, the free list plus unreferenced cached pages (evicted
            # and scrubbed on demand); equal to pool_pages whenever no request holds a page (seal 8)
            "free_pages": self.allocator.num_free,
            "owned_pages": self.allocator.num_owned,
            "cached_pages": self.prefix_cache.num_cached,
            "cached_pages_in_use": self.prefix_cache.num_referenced,
            "prefix_cache_hit_tokens": self.scheduler.reused_tokens,
            "prefix_cache_evicted_pages": self.prefix_cache.evicted_pages,
            # the sliding layers' own pool (kv/window.py): their window, pages, free pages, pages dropped so far
            "window_pool": None if self.window is None else {
                "window": self.window.window, "layers": len(self.window.layers), "pages": self.window.pool.num_pages,
                "free_pages": self.window.allocator.num_free, "dropped_pages": self.window.pages_dropped},
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # per tenant: tokens served, VTC counter, weight, queue time, pages held (engine/fairness.py)
            "tenants": self.scheduler.fair.figures(self.scheduler.running, self.scheduler.waiting),
            "pages_scrubbed": self.pages_scrubbed,
            "ownership_violations": self.ownership_violations,
            # response_format: requests waiting for their grammar, compiler processes, compiles killed at the limit
            "waiting_for_grammar": len(self.compiling),
            "grammar_compilers": 0 if self.grammars.pool is None else len(self.grammars.pool.pids),
            "grammar_compiles_killed": 0 if self.grammars.pool is None else self.grammars.pool.killed,
        }

    def has_work(self) -> bool:
        """True while a step would do something: sequences to run or outputs to hand out."""
        return self.scheduler.num_unfinished > 0 or bool(self._out) or bool(self.compiling) or self.grammars.busy

    # -- requests ------------------------------------------------------------------------------------
    def validate(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if num_prompt + max_tokens > self.context_window:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {self.context_window} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the messages, {max_tokens} in "
                f"the completion). Please reduce the length of the messages or completion.",
                param="messages",
            )

    def add_request(self, req: GenerateRequest) -> None:
        seq = self._admit(req)
        if seq is not None:
            self._with_grammar(seq, partial(self.scheduler.add, seq))

    def _with_grammar(self, seq: Sequence, then: Callable[[], None]) -> None:
        """Run `then` once seq's grammar is compiled and its matcher set (at once without a response_format or with
        the tenant's cached grammar); until then seq waits in `compiling`. A format that cannot be enforced ends
        seq (REJECTED before it ran, FAILED after: decode holds its verified KV then)."""
        fmt = seq.params.response_format
        if fmt is None or seq.grammar is not None:
            then()
            return
        got = self.grammars.compiled(seq.tenant, fmt)
        if got is None:
            self.compiling[seq.request_id] = (seq, then)
        elif isinstance(got, KvsealError):
            self.compiling.pop(seq.request_id, None)
            end = seq.life.reject if seq.life.state in (State.ADMITTED, State.RESERVED) else seq.life.fail
            self._end(seq, partial(end, got))
        else:
            self.compiling.pop(seq.request_id, None)
            seq.grammar = self.grammars.matcher(got)
            then()

    def _grammars_arrived(self) -> None:
        """Take in the compiles that ended; the requests that waited for them join the batch (or end). With nothing
        else to run, waits a little for one (the loop would only spin)."""
        if not self.grammars.busy:
            return
        if self.grammars.poll(wait=0.0 if self.scheduler.num_unfinished else 0.02):
            for seq, then in list(self.compiling.values()):
                self._with_grammar(seq, then)

    def _admit(self, req: GenerateRequest) -> Sequence | None:
        """Validate and register a request (ADMITTED); a refusal ends it REJECTED with its final delta."""
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng).item())
        seq = Sequence(req, self.allocator.new_owner(), IncrementalDecoder(self.tokenizer), seed)
        root = namespace_root(req.tenant, req.cache_salt)
        seq.cache_ns = namespace_id(root)
        if self.prefix_cache.enabled:
            seq.cache_keys = page_keys(root, req.prompt_ids, self.pool.page_size)
        try:
            if req.v != SCHEMA_VERSION:
                raise InvalidRequest(f"message schema v{req.v} is not v{SCHEMA_VERSION}: upgrade the peer")
            if req.request_id in self.seqs:
                raise InvalidRequest(f"request id {req.request_id!r} is already in use")
            self.validate(len(req.prompt_ids), req.params.max_tokens)
            check_sampling(req.params)
            if not (0 < req.weight <= 1e6 and 0 < req.kv_share <= 1):  # from the router: a peer's frame, checked
                raise InvalidRequest(f"weight {req.weight} or kv_share {req.kv_share} out of range")
            if len(self.scheduler.waiting) + len(self.compiling) >= self.cfg.scheduler.max_waiting:
                raise Overloaded("the server is overloaded: too many queued requests; retry later")
            if any(t < 0 or t >= self.arch.vocab_size for t in req.prompt_ids):
                raise InvalidRequest("a prompt token id is outside the vocabulary", param="prompt")
            if req.params.response_format is not None:  # too large or malformed: refused here, nothing compiles
                self.grammars.compiled(req.tenant, req.params.response_format)  # starts its compile
        except KvsealError as err:
            seq.life.reject(err)
            self._out.append(self._final(seq))
            return None
        seq.life.advance(State.ADMITTED)
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        self._forget(request_id)
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        self._end(seq, partial(seq.life.abort, cause or RequestAborted(f"request {request_id} was aborted")))

    def fail(self, request_id: str, error: KvsealError) -> None:
        """End one live request FAILED with `error`, pages freed; an unknown or ended request: nothing."""
        self._forget(request_id)
        seq = self.seqs.get(request_id)
        if seq is not None:
            self._end(seq, partial(seq.life.fail, error))

    def fail_all(self, error: KvsealError) -> list[GenerateDelta]:
        """After an internal fault: end every live request FAILED with `error`, pages freed, and no book of a
        role (reservations, handoffs) keeps naming one of them, so a late peer message finds nothing."""
        for seq in list(self.seqs.values()):
            self._forget(seq.request_id)
            self._end(seq, partial(seq.life.fail, error))
        out, self._out = self._out, []
        return out

    def _forget(self, request_id: str) -> None:
        """Drop what a role keeps about a request besides its Sequence (subclasses: reservations, handoffs)."""

    def take_output(self) -> list[GenerateDelta]:
        """The deltas produced between steps (decode: a verified request's first token), handed out at once."""
        out, self._out = self._out, []
        return out

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> list[GenerateDelta]:
        self._grammars_arrived()
        now = time.monotonic()
        for seq in self.scheduler.expired(now):
            self._end(seq, partial(seq.life.reject, Overloaded(
                f"no KV pages became free within {self.cfg.scheduler.wait_timeout_s:g}s; retry later")))
        batch, preempted = self.scheduler.schedule()
        for seq in preempted:
            seq.life.advance(State.ADMITTED)
        for seq in batch.seqs:
            if seq.life.state is State.ADMITTED:
                seq.life.advance(State.PREFILLING)
        if batch.seqs:
            if self.step_threads is not None:
                self._set_step_threads(sum(batch.num_new))
            result = self.runner.run(batch)
            self.ownership_violations += len(result.violations)
            for seq in result.violations:
                self._end(seq, partial(seq.life.fail, PageOwnershipViolation(
                    f"request {seq.request_id}: its page table names pages it does not own; no output")))
            for seq, n in zip(batch.seqs, batch.num_new):
                if seq in result.violations:
                    continue
                if self.forensics is not None:
                    self.forensics.after_step(seq, n)
                self.scheduler.drop_out_of_window(seq)  # sliding layers' pages no later query sees (kv/window.py)
                # the step that completed the prompt: its full pages are final (never written again) -> cache
                if seq.cache_keys and seq.num_computed - n < len(seq.prompt_ids) <= seq.num_computed:
                    self._cache_prompt(seq)
            if result.logits is not None:
                # logprobs from the model's own distribution, not the grammar's mask (as vLLM): the unmasked rows
                raw = result.logits.clone() if any(s.grammar is not None and s.params.logprobs is not None
                                                   for s in result.sampled) else result.logits
                self.grammars.mask(result.logits, [s.grammar for s in result.sampled])
                tokens, lps = sample(result.logits, [s.params for s in result.sampled],
                                     [s.seed for s in result.sampled],
                                     [len(s.output_ids) for s in result.sampled], raw)
                for seq, tok, lp in zip(result.sampled, tokens, lps):
                    self._on_sampled(seq, tok, lp)
        out, self._out = self._out, []
        return out

    def _cache_prompt(self, seq: Sequence) -> None:
        # past the seal-5 check every page here is seq's own or held by it: insert() cannot raise NotOwner
        full = len(seq.prompt_ids) // self.pool.page_size
        self.prefix_cache.insert(seq.owner, seq.cache_ns, seq.cache_keys[:full], seq.pages[:full])

    def _set_step_threads(self, tokens: int) -> None:
        assert self.step_threads is not None
        small, big, big_from = self.step_threads
        n = big if tokens >= big_from else small
        if n != self._threads_now and self.kernels == "native":
            from kvseal.kernels.ops import set_threads

            set_threads(n)
            self._threads_now = n

    def _on_sampled(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        """A sequence's next token is due; the prefill engine hands off here instead."""
        self._append(seq, tok, lp)

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        if seq.life.state in (State.PREFILLING, State.VERIFIED):
            seq.life.advance(State.DECODING)
        p = seq.params
        if seq.grammar is not None and not seq.grammar.accept_token(tok):  # only a peer's first token can
            self._end(seq, partial(seq.life.fail, InternalError(
                f"request {seq.request_id}: token {tok} breaks its response_format; no output")))
            return
        grammar_done = seq.grammar is not None and seq.grammar.is_terminated()  # tok is a stop token then
        seq.output_ids.append(tok)
        if lp is not None:
            seq.pending_logprobs.append(lp)
        n_out = len(seq.output_ids)
        reason: FinishReason | None = None
        stop_token = tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.eos_ids)
        if grammar_done or (stop_token and n_out > p.min_tokens):
            reason = FinishReason.STOP
        else:
            seq.text += seq.decoder.feed(tok)
            if p.stop and n_out > p.min_tokens:
                longest = max(len(s) for s in p.stop)
                lo = max(0, seq.sent_chars - longest)
                hits = [i for i in (seq.text.find(s, lo) for s in p.stop) if i >= 0]
                if hits:
                    seq.text = seq.text[: min(hits)]
                    reason = FinishReason.STOP
        if reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.context_window):
            reason = FinishReason.LENGTH
            seq.text += seq.decoder.flush()
        if reason is None:
            hold = max((len(s) for s in p.stop), default=1) - 1  # a stop string may still be forming
            self._out.append(self._delta(seq, len(seq.text) - hold))
        else:
            self._end(seq, partial(seq.life.finish, reason))

    def _end(self, seq: Sequence, terminate: Callable[[], bool]) -> None:
        """Move seq to a terminal state, free (and scrub) its pages, then emit its one final delta."""
        if not terminate():
            return
        self.compiling.pop(seq.request_id, None)
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if self.forensics is not None:
            error = seq.life.outcome.error if seq.life.outcome is not None else None
            self.forensics.row(seq, seq.life.state.value, error.code if error is not None else None)
        self._out.append(self._final(seq))

    def _delta(self, seq: Sequence, upto: int) -> GenerateDelta:
        upto = max(upto, seq.sent_chars)
        text, seq.sent_chars = seq.text[seq.sent_chars : upto], upto
        toks, seq.sent_tokens = seq.output_ids[seq.sent_tokens :], len(seq.output_ids)
        lps, seq.pending_logprobs = (seq.pending_logprobs or None), []
        return GenerateDelta(seq.request_id, toks, text, lps, prompt_tokens=len(seq.prompt_ids),
                             completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens)

    def _final(self, seq: Sequence) -> GenerateDelta:
        outcome = seq.life.outcome
        assert outcome is not None
        d = self._delta(seq, len(seq.text))
        match outcome.state:
            case State.FINISHED:
                assert outcome.finish_reason is not None
                return _with(d, final=outcome.finish_reason.value)
            case State.REJECTED | State.ABORTED | State.FAILED:
                assert outcome.error is not None
                return _with(d, final=outcome.state.value, error=outcome.error.to_info(),
                             stage=seq.life.ended_from.value)
            case _:
                raise AssertionError(f"{seq.request_id}: final delta for non-terminal {outcome.state}")


def _with(d: GenerateDelta, **kw: object) -> GenerateDelta:
    return msgspec.structs.replace(d, **kw)
