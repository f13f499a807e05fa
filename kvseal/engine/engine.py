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

import torch

from kvseal.config import EngineConfig
from kvseal.engine.connector import KVConnector
from kvseal.engine.devices import DTYPES, resolve_device, resolve_kv_dtype
from kvseal.engine.figures import engine_figures, engine_info
from kvseal.engine.output import final_delta, next_delta, take_token
from kvseal.engine.params import check_request, check_window
from kvseal.engine.pools import build_pools
from kvseal.engine.runner import ModelRunner
from kvseal.engine.sampling import sample
from kvseal.engine.scheduler import Scheduler
from kvseal.engine.sequence import Sequence
from kvseal.engine.structured import Grammars
from kvseal.errors import (
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
from kvseal.kv.allocator import PageAllocator
from kvseal.kv.prefix_cache import PrefixCache, namespace_id, namespace_root, page_keys
from kvseal.ledger.forensics import Forensics
from kvseal.ledger.store import Ledger
from kvseal.lifecycle import State
from kvseal.model.checkpoint import Checkpoint
from kvseal.model.detokenize import IncrementalDecoder
from kvseal.model.llama import LlamaModel
from kvseal.model.loader import load_checkpoint
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateDelta, GenerateRequest, TokenLogprob
from kvseal.wire.roles import Role

log = logging.getLogger("kvseal.engine")


class Engine:
    def __init__(self, cfg: EngineConfig, ckpt: Checkpoint | None = None, role: Role = Role.UNIFIED) -> None:
        self.cfg, self.role = cfg, role
        keep_freed_pages()
        ckpt = ckpt if ckpt is not None else load_checkpoint(cfg.model.path)
        self.ckpt_name, self.fingerprint, self.tokenizer = ckpt.name, ckpt.fingerprint, ckpt.tokenizer
        self.arch = arch = ckpt.arch
        self.device = resolve_device(cfg.model.device)
        self.dtype = DTYPES[cfg.model.dtype]
        self.kernels, why = resolve_kernels(cfg.model.kernels, self.device.type, cfg.model.dtype, arch)
        # the window the model supports and the operator allows (the pool may hold less: context_window)
        self.model_window = model_window = min(arch.max_position, cfg.model.max_model_len or arch.max_position)
        self.arithmetic = resolve_arithmetic(cfg.model.arithmetic, self.kernels, why, arch, cfg.cache.page_size,
                                             ckpt.block_types())
        log.info("arithmetic: %s%s (%s)", self.arithmetic.name,
                 f" on {self.arithmetic.isa}" if self.arithmetic.isa else "", self.arithmetic.why)
        self.kv_dtype = DTYPES[resolve_kv_dtype(cfg.cache.kv_dtype, cfg.model.dtype, self.arithmetic.fast)]
        if self.kv_dtype != self.dtype and not self.arithmetic.fast and self.kernels == "native":
            raise ValueError(f"--kv-dtype {cfg.cache.kv_dtype} with --dtype {cfg.model.dtype} needs the fast "
                             "arithmetic or --kernels torch (the exact native kernels read float32 KV). Fix: "
                             "--arithmetic fast, or drop --kv-dtype")
        self.model = LlamaModel(ckpt, self.dtype, self.device, native=self.kernels == "native",
                                fast=self.arithmetic.fast, max_model_len=model_window)
        self.pages_scrubbed = 0  # seal 6, for /info and /metrics
        # sliding-window layers in a pool of their own that keeps only each sequence's window (kv/window.py)
        self.pool, self.window = build_pools(arch, self.model.windows, cfg, role, self.kv_dtype, self.device,
                                             "kt" if self.arithmetic.fast else "std", model_window,
                                             self._count_scrubbed)
        num_pages = self.pool.num_pages
        self.forensics: Forensics | None = None
        self.ownership_violations = 0  # seal 5 failures
        self.allocator = PageAllocator(num_pages, scrubber=self._scrub if cfg.cache.scrub else None)
        self.ledger = Ledger(cfg.ledger.path) if cfg.ledger.path else None
        if self.ledger is not None:
            self.forensics = Forensics(self.ledger, self.allocator, cfg.cache.page_size, role)
        # decode workers keep no prefix cache: prefill computes every prompt (see docs/architecture.md); nor does an
        # engine whose sliding layers drop their pages: a cached prefix would need their last window too
        self.prefix_cache = PrefixCache(self.allocator, enabled=cfg.cache.prefix_cache and role != Role.DECODE
                                        and self.window is None)
        self.kv_layout = self.pool.layout_name
        # what this engine's KV is: a reservation, a manifest and the fleet check carry it (wire/kvspec.py)
        self.kv_spec = KVSpec(model_fingerprint=self.fingerprint, page_size=self.pool.page_size,
                              kv_dtype=str(self.kv_dtype).removeprefix("torch."), kv_layout=self.kv_layout)
        # The served window: what the model supports, the operator allows, and the pool can hold.
        self.context_window = min(model_window, self.pool.capacity_tokens)
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, cfg.cache.page_size, self.prefix_cache, self.window)
        self.runner = ModelRunner(self.model, self.pool, self.allocator, self.window)
        self.grammars = Grammars(self.tokenizer, arch.vocab_size, cfg.grammar)  # response_format (structured.py)
        # the one home of this engine's live requests: a request's state is its Sequence (and nothing keyed by its
        # id elsewhere); it leaves at its end, with its final delta
        self.seqs: dict[str, Sequence] = {}
        # a disaggregated role's handoff (engine/connector.py): a connector attaches itself (kv_prefill, kv_decode)
        self.kv = KVConnector()
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

    # -- what this engine is (engine/figures.py) ---------------------------------------------------
    def info(self) -> dict[str, object]:
        return engine_info(self)

    def figures(self) -> dict[str, object]:
        return engine_figures(self)

    def has_work(self) -> bool:
        """True while a step would do something: sequences to run or outputs to hand out."""
        return self.scheduler.num_unfinished > 0 or bool(self._out) or self.grammars.busy or bool(self.compiling())

    def compiling(self) -> list[Sequence]:
        """Admitted, outside the scheduler (holding no pages; decode: holding its verified KV), waiting for their
        grammar to compile: the batch keeps stepping meanwhile."""
        return [s for s in self.seqs.values() if s.after_grammar is not None]

    # -- requests ------------------------------------------------------------------------------------
    def validate(self, num_prompt: int, max_tokens: int) -> None:
        check_window(num_prompt, max_tokens, self.context_window)

    def add_request(self, req: GenerateRequest) -> None:
        seq = self.admit(req)
        if seq.life.terminal:
            self._out.append(final_delta(seq))
        else:
            self.with_grammar(seq, partial(self.scheduler.add, seq))

    def with_grammar(self, seq: Sequence, then: Callable[[], None]) -> None:
        """Run `then` once seq's grammar is compiled and its matcher set (at once without a response_format or with
        the tenant's cached grammar); until then seq waits (`compiling`). A format that cannot be enforced ends
        seq (REJECTED before it ran, FAILED after: decode holds its verified KV then)."""
        fmt = seq.params.response_format
        if fmt is None or seq.grammar is not None:
            then()
            return
        got = self.grammars.compiled(seq.tenant, fmt)
        seq.after_grammar = then if got is None else None
        if isinstance(got, KvsealError):
            end = seq.life.reject if seq.life.state in (State.ADMITTED, State.RESERVED) else seq.life.fail
            self.end(seq, partial(end, got))
        elif got is not None:
            seq.grammar = self.grammars.matcher(got)
            then()

    def _grammars_arrived(self) -> None:
        """Take in the compiles that ended; the requests that waited for them join the batch (or end). With nothing
        else to run, waits a little for one (the loop would only spin)."""
        if not self.grammars.busy:
            return
        if self.grammars.poll(wait=0.0 if self.scheduler.num_unfinished else 0.02):
            for seq in self.compiling():
                assert seq.after_grammar is not None
                self.with_grammar(seq, seq.after_grammar)

    def admit(self, req: GenerateRequest) -> Sequence:
        """Validate and register a request (ADMITTED). A refused one comes back REJECTED and unregistered: its
        caller answers it (a final delta; decode: the reservation's refusal)."""
        seed = req.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng).item())
        seq = Sequence(req, self.allocator.new_owner(), IncrementalDecoder(self.tokenizer), seed)
        root = namespace_root(req.tenant, req.cache_salt)
        seq.cache_ns = namespace_id(root)
        if self.prefix_cache.enabled:
            seq.cache_keys = page_keys(root, req.prompt_ids, self.pool.page_size)
        try:
            check_request(req, self.context_window, self.arch.vocab_size)  # engine/params.py
            if req.request_id in self.seqs:
                raise InvalidRequest(f"request id {req.request_id!r} is already in use")
            if len(self.scheduler.waiting) + len(self.compiling()) >= self.cfg.scheduler.max_waiting:
                raise Overloaded("the server is overloaded: too many queued requests; retry later")
            if req.params.response_format is not None:  # too large or malformed: refused here, nothing compiles
                self.grammars.compiled(req.tenant, req.params.response_format)  # starts its compile
        except KvsealError as err:
            seq.life.reject(err)
            return seq
        seq.life.advance(State.ADMITTED)
        self.seqs[req.request_id] = seq
        return seq

    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        self.end(seq, partial(seq.life.abort, cause or RequestAborted(f"request {request_id} was aborted")))

    def fail(self, request_id: str, error: KvsealError) -> None:
        """End one live request FAILED with `error`, pages freed; an unknown or ended request: nothing."""
        seq = self.seqs.get(request_id)
        if seq is not None:
            self.end(seq, partial(seq.life.fail, error))

    def fail_all(self, error: KvsealError) -> list[GenerateDelta]:
        """After an internal fault: end every live request FAILED with `error`, pages freed. Each leaves `seqs`, the
        one home of its handoff state too (reservation, handoff), so a late peer message finds nothing."""
        for seq in list(self.seqs.values()):
            self.end(seq, partial(seq.life.fail, error))
        out, self._out = self._out, []
        return out

    def take_output(self) -> list[GenerateDelta]:
        """The deltas produced between steps (decode: a verified request's first token), handed out at once."""
        out, self._out = self._out, []
        return out

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> list[GenerateDelta]:
        self._grammars_arrived()
        now = time.monotonic()
        for seq in self.scheduler.expired(now):
            self.end(seq, partial(seq.life.reject, Overloaded(
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
                self.end(seq, partial(seq.life.fail, PageOwnershipViolation(
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
                    if self.kv.after_prefill(seq, tok, lp):  # prefill: decode takes it from here
                        self.scheduler.park(seq)  # out of the batch; its pages stay owned until the handoff ends
                    else:
                        self._append(seq, tok, lp)
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

    def join_batch(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """A request whose prompt's KV is in its pages (decode: verified) joins the batch with its first token."""
        seq.first_scheduled = time.monotonic()
        self.scheduler.add(seq)
        self._append(seq, first_token, first_logprob)

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        if seq.life.state in (State.PREFILLING, State.VERIFIED):
            seq.life.advance(State.DECODING)
        if seq.grammar is not None and not seq.grammar.accept_token(tok):  # only a peer's first token can
            self.end(seq, partial(seq.life.fail, InternalError(
                f"request {seq.request_id}: token {tok} breaks its response_format; no output")))
            return
        reason = take_token(seq, tok, lp, self.tokenizer.eos_ids, self.context_window)
        if reason is None:
            self._out.append(next_delta(seq))
        else:
            self.end(seq, partial(seq.life.finish, reason))

    def end(self, seq: Sequence, terminate: Callable[[], bool]) -> None:
        """Move seq to a terminal state, free (and scrub) its pages, then emit its one final delta. The connector
        may keep the pages (bytes may still land in them): it frees them when that is over."""
        if not terminate():
            return
        seq.after_grammar = None
        if not self.kv.request_finished(seq):
            self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if self.forensics is not None:
            error = seq.life.outcome.error if seq.life.outcome is not None else None
            self.forensics.row(seq, seq.life.state.value, error.code if error is not None else None)
        self._out.append(final_delta(seq))
