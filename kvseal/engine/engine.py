"""The engine: requests in, token deltas out, one step at a time. Single-threaded by design.

Every request that enters through add_request() leaves through exactly one final GenerateDelta (seal 1),
emitted only after its pages were scrubbed and freed (seals 6 and 8).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Pages
from functools import partial
from itertools import accumulate
from typing import TypeVar

import torch

from kvseal.config import EngineConfig
from kvseal.engine.connector import KVConnector
from kvseal.engine.devices import place
from kvseal.engine.drafts import Drafter
from kvseal.engine.figures import engine_card, engine_figures, engine_info
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.engine.output import final_delta, next_delta, take_token
from kvseal.engine.params import check_request, check_window
from kvseal.engine.pools import build_pools
from kvseal.engine.requests import Requests
from kvseal.engine.runner import ModelRunner, StepResult
from kvseal.engine.sampling import sample
from kvseal.engine.scheduler import Batch, Scheduler
from kvseal.engine.sequence import Route, Sequence
from kvseal.engine.structured import Grammars
from kvseal.errors import (
    InternalError,
    InvalidRequest,
    KvsealError,
    Overloaded,
    PageOwnershipViolation,
    RequestAborted,
)
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
from kvseal.wire.card import WorkerCard
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.messages import GenerateDelta, GenerateRequest, TokenLogprob
from kvseal.wire.roles import Role

C = TypeVar("C", bound=KVConnector)
Pick = tuple[Sequence, list[int], list[TokenLogprob | None]]  # a sequence's new tokens this step, their logprobs
# what each role adds to the one Engine (engine/connector.py): the engine builds its own from its role
CONNECTORS: dict[Role, type[KVConnector]] = {Role.UNIFIED: KVConnector, Role.PREFILL: PrefillConnector,
                                             Role.DECODE: DecodeConnector}


class Engine:
    def __init__(self, cfg: EngineConfig, ckpt: Checkpoint | None = None, role: Role = Role.UNIFIED) -> None:
        self.cfg, self.role = cfg, role
        keep_freed_pages()
        ckpt = ckpt if ckpt is not None else load_checkpoint(cfg.model.path)
        self.ckpt_name, self.fingerprint, self.tokenizer = ckpt.name, ckpt.fingerprint, ckpt.tokenizer
        self.arch = arch = ckpt.arch
        at = place(cfg, ckpt)  # engine/devices.py
        self.device, self.dtype, self.kv_dtype, self.kernels, self.arithmetic = (
            at.device, at.dtype, at.kv_dtype, at.kernels, at.arithmetic)
        # the window the model supports and the operator allows (the pool may hold less: context_window)
        self.model_window = model_window = min(arch.max_position, cfg.model.max_model_len or arch.max_position)
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
        # the one home of this engine's requests (engine/requests.py): a request's state is its Sequence, and nothing
        # keyed by its id is kept anywhere else, by the engine or by its worker
        self.requests = Requests()
        self.scheduler = Scheduler(cfg.scheduler, self.allocator, cfg.cache.page_size, self.requests,
                                   self.prefix_cache, self.window)
        self.runner = ModelRunner(self.model, self.pool, self.allocator, self.window)
        self.grammars = Grammars(self.tokenizer, arch.vocab_size, cfg.grammar)  # response_format (structured.py)
        self.drafter = Drafter(cfg.scheduler)  # speculative decoding (engine/drafts.py): decode and unified only
        self.drafter.on &= role != Role.PREFILL
        self.kv = CONNECTORS[role](self)  # a disaggregated role's handoff (engine/connector.py)
        self._out: list[tuple[Sequence, GenerateDelta]] = []  # each delta with the request it is for (its route)
        self._rng = torch.Generator().manual_seed(cfg.seed)

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

    def card(self, **worker: object) -> WorkerCard:
        """This engine's part of its worker's card (wire/card.py), with the worker's own fields."""
        return engine_card(self, **worker)

    def connector(self, kind: type[C]) -> C:
        """The connector this engine built from its role, as the worker of that role uses it."""
        assert isinstance(self.kv, kind), f"a {self.role} engine has no {kind.__name__}"
        return self.kv

    def set_worker(self, endpoint: str) -> None:
        """The worker serving this engine names itself (the ledger's rows say where a request ran)."""
        if self.forensics is not None:
            self.forensics.worker = endpoint

    def on_first_scheduled(self, observe: Callable[[float], None]) -> None:
        """Metrics: called with the seconds from arrival to first scheduled, for each request."""
        self.scheduler.on_first_scheduled = observe

    def close(self) -> None:
        self.grammars.close()  # its compiler processes end with it
        if self.ledger is not None:
            self.ledger.close()

    # -- its requests (engine/requests.py) ---------------------------------------------------------
    def has_work(self) -> bool:
        """True while a step would do something: sequences to run or outputs to hand out."""
        return self.scheduler.num_unfinished > 0 or bool(self._out) or self.grammars.busy or bool(self.compiling())

    def is_live(self, request_id: str) -> bool:
        return request_id in self.requests

    def request(self, request_id: str) -> Sequence | None:
        """The live request with this id (queued ones too)."""
        return self.requests.live(request_id)

    def inflight(self) -> int:
        """Live requests, queued ones included."""
        return len(self.requests)

    def routed_to(self, ident: bytes) -> list[Sequence]:
        return self.requests.routed_to(ident)

    def compiling(self) -> list[Sequence]:
        """Admitted, outside the scheduler (holding no pages; decode: holding its verified KV), waiting for their
        grammar to compile: the batch keeps stepping meanwhile."""
        return [s for s in self.requests if s.after_grammar is not None]

    # -- requests in -------------------------------------------------------------------------------
    def validate(self, num_prompt: int, max_tokens: int) -> None:
        check_window(num_prompt, max_tokens, self.context_window)

    def add_request(self, req: GenerateRequest, route: Route | None = None) -> Sequence:
        """Admit req into the batch (once its grammar is compiled). Refused, it ends at once: its final delta says
        why."""
        seq = self.receive(req, route)
        if not seq.life.terminal and self.admit(seq):
            self.with_grammar(seq, partial(self.scheduler.add, seq))
        else:
            self._out.append((seq, final_delta(seq)))
        return seq

    def receive(self, req: GenerateRequest, route: Route | None = None) -> Sequence:
        """req's Sequence, RECEIVED and in `requests` (decode: queued until pages are reserved); REJECTED, and kept
        nowhere, when its id is in use here."""
        seq = Sequence(req, self.allocator.new_owner(), IncrementalDecoder(self.tokenizer), 0)
        seq.route = route
        if self.requests.known(req.request_id) is not None:
            seq.life.reject(InvalidRequest(f"request id {req.request_id!r} is already in use"))
        else:
            self.requests.add(seq)
        return seq

    def admit(self, seq: Sequence) -> bool:
        """Validate a received request (ADMITTED). A refused one is REJECTED and leaves `requests`: its caller
        answers it (a final delta; decode: the reservation's refusal)."""
        req = seq.request
        seq.seed = req.params.seed if req.params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._rng).item())
        seq.arrival = time.monotonic()
        root = namespace_root(req.tenant, req.cache_salt)
        seq.cache_ns = namespace_id(root)
        if self.prefix_cache.enabled:
            seq.cache_keys = page_keys(root, req.prompt_ids, self.pool.page_size)
        try:
            check_request(req, self.context_window, self.arch.vocab_size)  # engine/params.py
            if len(self.scheduler.waiting) + len(self.compiling()) >= self.cfg.scheduler.max_waiting:
                raise Overloaded("the server is overloaded: too many queued requests; retry later")
            if req.params.response_format is not None:  # too large or malformed: refused here, nothing compiles
                self.grammars.compiled(req.tenant, req.params.response_format)  # starts its compile
        except KvsealError as err:
            seq.life.reject(err)
            self.requests.drop(seq)
            return False
        seq.life.advance(State.ADMITTED)
        return True

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

    def join_batch(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """A request whose prompt's KV is in its pages (decode: verified) joins the batch with its first token."""
        seq.first_scheduled = time.monotonic()
        self.scheduler.add(seq)
        self._append(seq, first_token, first_logprob)

    # -- requests out ------------------------------------------------------------------------------
    def abort(self, request_id: str, cause: KvsealError | None = None) -> None:
        seq = self.requests.live(request_id)
        if seq is not None:
            self.end(seq, partial(seq.life.abort, cause or RequestAborted(f"request {request_id} was aborted")))

    def fail(self, request_id: str, error: KvsealError) -> None:
        """End one live request FAILED with `error`, pages freed; an unknown or ended request: nothing."""
        seq = self.requests.live(request_id)
        if seq is not None:
            self.end(seq, partial(seq.life.fail, error))

    def fail_all(self, error: KvsealError) -> None:
        """After an internal fault: end every request here FAILED with `error`, pages freed; their final deltas wait
        in the output. Each leaves `requests`, the one home of its handoff state too, so a late peer message finds
        nothing. A reservation still waiting for pages (decode) took no part in the fault: it stays queued."""
        for seq in self.requests.here():
            self.end(seq, partial(seq.life.fail, error))

    def take_output(self) -> list[GenerateDelta]:
        """The deltas produced since the last take (in a step, or between steps: decode's first token)."""
        return [d for _, d in self.take_addressed()]

    def take_addressed(self) -> list[tuple[Sequence, GenerateDelta]]:
        """The same, each with its Sequence: a worker reads where it goes (`Sequence.route`), ended or not."""
        out, self._out = self._out, []
        return out

    def end(self, seq: Sequence, terminate: Callable[[], bool]) -> None:
        """Move seq to a terminal state, free (and scrub) its pages, then emit its one final delta. The connector
        may keep the pages (bytes may still land in them): seq stays in `requests`, quarantined, until that is over.
        A reservation still queued (decode) holds nothing and leaves without a delta: its worker answers it."""
        queued = seq.life.state is State.RECEIVED
        if not terminate():
            return
        if queued:
            self.requests.drop(seq)
            return
        seq.after_grammar = None
        if not self.kv.request_finished(seq):
            self.scheduler.remove(seq)
            self.requests.drop(seq)
        if self.forensics is not None:
            error = seq.life.outcome.error if seq.life.outcome is not None else None
            spec = seq.spec.length if seq.spec is not None else None
            self.forensics.row(seq, seq.life.state.value, error.code if error is not None else None,
                               spec.drafted if spec else 0, spec.accepted if spec else 0)
        self._out.append((seq, final_delta(seq)))

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> list[GenerateDelta]:
        """One step of the batch; the deltas it produced (and any produced since the last take)."""
        self.advance()
        return self.take_output()

    def advance(self) -> None:
        """One step: compiled grammars in, requests refused pages too long out, then the batch runs and samples."""
        self._grammars_arrived()
        for seq in self.scheduler.expired(time.monotonic()):
            self.end(seq, partial(seq.life.reject, Overloaded(
                f"no KV pages became free within {self.cfg.scheduler.wait_timeout_s:g}s; retry later")))
        self.drafter.propose(self.scheduler.waiting, self.scheduler.running, self.context_window)
        batch, preempted = self.scheduler.schedule()
        for seq in preempted:
            seq.life.advance(State.ADMITTED)
        for seq in batch.seqs:
            if seq.life.state is State.ADMITTED:
                seq.life.advance(State.PREFILLING)
        if batch.seqs:
            result = self._run(batch)
            picks, rejected = self._pick(result)
            self._after_step(batch, result, rejected)
            self._emit(picks)

    def _run(self, batch: Batch) -> StepResult:
        """The forward pass; a sequence whose page table names pages it does not own fails (seal 5)."""
        result = self.runner.run(batch)
        self.ownership_violations += len(result.violations)
        for seq in result.violations:
            self.end(seq, partial(seq.life.fail, PageOwnershipViolation(
                f"request {seq.request_id}: its page table names pages it does not own; no output")))
        return result

    def _after_step(self, batch: Batch, result: StepResult, rejected: dict[int, int]) -> None:
        """Each sequence's ledger record of the positions it kept, its sliding window's dropped pages, and a
        completed prompt's pages cached."""
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq in result.violations:
                continue
            dropped = rejected.get(id(seq), 0)
            if dropped:
                self.scheduler.shrink(seq)
            if self.forensics is not None:
                self.forensics.after_step(seq, n - dropped)
            self.scheduler.after_step(seq, n - dropped)

    def _pick(self, result: StepResult) -> tuple[list[Pick], dict[int, int]]:
        """The next tokens of each sequence due some: one sampled (logprobs from the model's own distribution, not
        the grammar's mask, as vLLM), or a draft's verified tokens (engine/drafts.py, which rolls num_computed back
        past its rejected positions: returned by id(seq))."""
        if result.logits is None:
            return [], {}
        logits = result.logits
        ends = list(accumulate(result.rows))  # each sequence's last row + 1
        plain = [i for i, r in enumerate(result.rows) if r == 1]
        rows = logits if len(plain) == len(ends) else logits[[ends[i] - 1 for i in plain]]
        seqs = [result.sampled[i] for i in plain]
        raw = rows.clone() if any(s.grammar is not None and s.params.logprobs is not None for s in seqs) else rows
        self.grammars.mask(rows, [s.grammar for s in seqs])
        tokens, lps = sample(rows, [s.params for s in seqs], [s.seed for s in seqs],
                             [len(s.output_ids) for s in seqs], raw)
        picks: list[Pick] = [(s, [t], [lp]) for s, t, lp in zip(seqs, tokens, lps)]
        rejected: dict[int, int] = {}
        for i, (seq, r) in enumerate(zip(result.sampled, result.rows)):
            if r > 1:
                toks, rejected[id(seq)] = self.drafter.verify(seq, logits[ends[i] - r:ends[i]])
                picks.append((seq, toks, [None] * len(toks)))
        return picks, rejected

    def _emit(self, picks: list[Pick]) -> None:
        """Take in each sequence's new tokens, one delta each (a stream shows one token an event, however many a
        draft gave). Prefill: the connector takes a sequence with its first token."""
        for seq, tokens, lps in picks:
            if self.kv.after_prefill(seq, tokens[0], lps[0]):  # prefill: decode takes it from here
                self.scheduler.park(seq)  # out of the batch; its pages stay owned until the handoff ends
                continue
            for tok, lp in zip(tokens, lps):
                self._append(seq, tok, lp)
                if seq.life.terminal:  # a stop among the accepted drafts: what followed it is not output
                    break

    def _grammars_arrived(self) -> None:
        """Take in the compiles that ended; the requests that waited for them join the batch (or end). With nothing
        else to run, waits a little for one (the loop would only spin)."""
        if not self.grammars.busy:
            return
        if self.grammars.poll(wait=0.0 if self.scheduler.num_unfinished else 0.02):
            for seq in self.compiling():
                assert seq.after_grammar is not None
                self.with_grammar(seq, seq.after_grammar)

    def _append(self, seq: Sequence, tok: int, lp: TokenLogprob | None) -> None:
        if seq.life.state in (State.PREFILLING, State.VERIFIED):
            seq.life.advance(State.DECODING)
        if seq.grammar is not None and not seq.grammar.accept_token(tok):  # only a peer's first token can
            self.end(seq, partial(seq.life.fail, InternalError(
                f"request {seq.request_id}: token {tok} breaks its response_format; no output")))
            return
        reason = take_token(seq, tok, lp, self.tokenizer.eos_ids, self.context_window)
        if reason is None:
            self._out.append((seq, next_delta(seq)))
        else:
            self.end(seq, partial(seq.life.finish, reason))
