"""One request inside an engine: its tokens, its pages and its lifecycle.

Invariant: pages hold the KV of all_ids[:num_computed], and len(pages) * page_size >= num_computed. The next
step feeds all_ids[num_computed : num_computed + n]; when that reaches num_tokens the last row's logits
give the next token. Prefill, chunked prefill, decode and recompute-after-preemption are all this one rule.
A prefix-cache hit is the same rule too: the cached pages come first in `pages` (held, read-only) and
num_computed starts at the end of them; every page written from there on is the sequence's own.
With a window pool (kv/window.py) the sliding layers' KV is in window_pages, which hold positions from
window_base * page_size on: the pages before it left the window and were dropped.
A worker keeps nothing of a request anywhere else (engine/requests.py holds the Sequences): its `route` says which
router asked and reads its answers; the handoff lives here too (engine/kv_prefill.py, engine/kv_decode.py). On
prefill its `handoff` from the first token until decode took the KV, with the transfer in flight and the
`reservation` it goes to; on decode it waits for pages in RECEIVED (queued: it holds none), then its
`reservation` from RESERVED until the arrived KV was verified (or the request ended), and `landing` while an
in-place transport may write its pages (ended meanwhile: quarantined, the pages still its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvseal.kv.allocator import Owner
from kvseal.lifecycle import Lifecycle
from kvseal.model.detokenize import IncrementalDecoder
from kvseal.wire.messages import GenerateRequest, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher

    from kvseal.engine.speculate import Speculation
    from kvseal.transfer.base import TransferHandle
    from kvseal.wire.reservation import Reservation


@dataclass
class Route:
    """Which router asked for a worker's request, and where its answers go (None in an engine without a worker)."""

    ident: bytes  # the router's socket identity
    call_id: int  # the call that brought it: ReserveResp (decode) or PrefillResp (prefill) answers it
    sent: int = 0  # decode: the deltas sent so far, the number the next one carries


@dataclass
class Handoff:
    """Prefill: the prompt's KV is computed and its first token sampled; decode has not taken the KV yet."""

    first_token: int
    first_logprob: TokenLogprob | None
    num_pages: int  # pages holding the prompt's KV: ceil(prompt_len / page_size)
    due: float | None = None  # when the KV may go (monotonic); None until the worker took it (a hook may hold it)
    transfer: TransferHandle | None = None  # the send in flight, until decode answers
    nbytes: int = 0  # what the send carried, for the router's answer: bytes and prompt tokens the cache served
    cached_tokens: int = 0
    sent_at: float = 0.0


class Sequence:
    def __init__(self, req: GenerateRequest, owner: Owner, decoder: IncrementalDecoder, seed: int) -> None:
        self.request = req  # as it arrived (admission checks it: engine/params.py)
        self.request_id = req.request_id
        self.prompt_ids: list[int] = list(req.prompt_ids)
        self.params: SamplingParams = req.params
        self.tenant = req.tenant
        # from the router's tenants file (engine/fairness.py): its share, its class; priority is the client's own
        # and orders it only among its tenant's requests
        self.weight, self.priority_class, self.kv_share = req.weight, req.priority_class, req.kv_share
        self.priority = req.priority
        # the prefix cache's view (set by the engine at admission): the namespace (tenant, cache_salt) and the
        # keys of the prompt's full pages; empty keys: this request neither uses nor fills the cache
        self.cache_ns = 0
        self.cache_keys: list[bytes] = []
        self.cached_tokens = 0  # prompt tokens served from the cache when it was first scheduled (usage)
        self.grammar: GrammarMatcher | None = None  # with a response_format: what may come next
        self.life = Lifecycle(req.request_id)
        self.owner = owner
        self.pages: list[int] = []
        self.window_pages: list[int] = []  # the sliding layers' pages (kv/window.py), from page window_base on
        self.window_base = 0
        self.num_computed = 0
        self.output_ids: list[int] = []
        self.decoder = decoder
        self.seed = seed  # sampling seed: the request's own, or one the engine drew for it
        self.text = ""  # all output text so far (stop strings removed once found)
        self.sent_chars = 0  # how much of `text` has been emitted
        self.sent_tokens = 0
        self.pending_logprobs: list[TokenLogprob] = []
        self.received = time.monotonic()  # reached this worker: a queued reservation waits from here
        self.arrival = self.received  # admitted (Engine.admit): fairness orders by it, queue time counts from it
        self.first_scheduled: float | None = None
        # since when this waiting sequence has been refused pages at every step it was considered (None
        # while it is not blocked on pages): a queue that is merely busy computing never times out
        self.blocked_since: float | None = None
        # admitted, waiting for its grammar to compile (outside the scheduler): what to do once its matcher is set
        self.after_grammar: Callable[[], None] | None = None
        # a worker's and the handoff's (None in a unified engine; see the module docstring)
        self.route: Route | None = None
        self.handoff: Handoff | None = None
        self.reservation: Reservation | None = None  # decode: its own; prefill: the one its KV goes to
        self.reserved_until = 0.0  # decode: the reservation ends then (monotonic) unless renewed or its KV arrived
        self.landing = False
        # speculative decoding (engine/drafts.py): this request's own lookup index and draft length, and the draft
        # fed in this step after its last token. A draft lives for one step of a running sequence: verified and
        # cleared after it (rejected positions are rewritten by the next step before any query reads them), and
        # cleared when the sequence is preempted.
        self.spec: Speculation | None = None
        self.draft: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_target(self) -> int:
        """The positions this step may reach: its tokens and its draft (the draft's KV is written, then kept only
        as far as it was accepted)."""
        return self.num_tokens + len(self.draft)

    @property
    def decode_tokens(self) -> int:
        """The tokens one decode step feeds: the last one sampled and its draft. The scheduler never caps them and
        never counts them as a prompt chunk."""
        return 1 + len(self.draft)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p and end <= self.num_tokens:
            return self.output_ids[start - p:end - p]
        return (self.prompt_ids + self.output_ids + self.draft)[start:end]

    def __repr__(self) -> str:
        return f"Sequence({self.request_id}, {self.life.state.name}, computed={self.num_computed}/{self.num_tokens})"
