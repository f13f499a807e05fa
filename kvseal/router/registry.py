"""Seal 7: capacity and consistency of the fleet, checked before the router serves anything and at every join.

The served context window is the smallest any eligible worker can hold. The router refuses to start when a
worker's KV pool holds fewer tokens than that window, or when workers disagree on the model fingerprint, page
size, KV dtype, KV layout, kernels, arithmetic or KV transport (`Agreement`). After start, the fleet as it started
is a `FleetSpec`, and a worker that connects, reconnects or registers must match it in full (`check_worker`), its
tokenizer and its test faults included, before it gets a request. Each message names both numbers and both fixes.

Every field checked here is read from the worker's typed card (wire/card.py): a worker whose card lacks one never
gets this far (its answer does not decode), so no check runs on a default.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.errors import CapacityMismatch
from kvseal.wire.card import WorkerCard
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.roles import Role


@dataclass(frozen=True)
class Agreement:
    """What every worker of one fleet shares. kernels/arithmetic: the kernel sets compute the same KV only up to
    rounding (exact) or quantization (fast); mixing them would make a disaggregated answer differ from a unified
    one, so the fleet agrees on one. kv_transport: a prefill worker hands KV only to a decode worker of its own."""

    kv: KVSpec
    kernels: str
    arithmetic: str
    kv_transport: str

    @staticmethod
    def of(card: WorkerCard) -> Agreement:
        return Agreement(card.kv, card.kernels, card.arithmetic, card.kv_transport)

    def differences(self, other: Agreement) -> list[tuple[str, object, object]]:
        """(field, ours, theirs) for every field but the transport in which `other` differs, named as /info names
        them: the KV spec's fields (model_fingerprint, page_size, kv_dtype, kv_layout), then kernels, arithmetic."""
        return [*self.kv.differences(other.kv),
                *((f, a, b) for f, a, b in (("kernels", self.kernels, other.kernels),
                                            ("arithmetic", self.arithmetic, other.arithmetic)) if a != b)]


def served_window(cards: list[tuple[str, WorkerCard]], max_model_len: int | None) -> int:
    """The window to serve: the router's --max-model-len, else the smallest model window of the fleet.

    cards: (worker name, its card) for every worker that may receive a request.
    """
    if not cards:
        raise CapacityMismatch("no workers: start at least one prefill and one decode worker")
    name, card = min(cards, key=lambda x: x[1].model_window)
    window = card.model_window
    if max_model_len is not None:
        if max_model_len > window:
            raise CapacityMismatch(
                f"--max-model-len {max_model_len} is larger than {name}'s model window of "
                f"{window} tokens. Fix: lower --max-model-len to {window} or less.")
        window = max_model_len
    return window


def check_fleet(cards: list[tuple[str, WorkerCard]], window: int) -> None:
    """Raise CapacityMismatch unless every worker can hold `window` tokens and all agree on the layout."""
    ref_name, ref = cards[0]
    for name, card in cards:
        _check_agree(ref_name, Agreement.of(ref), name, Agreement.of(card))
        _check_pool(name, card, window)


def _check_agree(ref_name: str, ref: Agreement, name: str, agreement: Agreement) -> None:
    differ = ref.differences(agreement)
    if differ:
        theirs = ", ".join(f"{key}={b!r}" for key, _, b in differ)
        ours = ", ".join(f"{key}={a!r}" for key, a, _ in differ)
        raise CapacityMismatch(
            f"{name} has {theirs} but {ref_name} has {ours}: KV computed by one cannot be used by the "
            f"other. Fix: start every worker with the same model, --page-size, --dtype, --kv-dtype, --kernels "
            f"and --arithmetic.")
    theirs_t, ours_t = agreement.kv_transport, ref.kv_transport
    if theirs_t != ours_t:
        raise CapacityMismatch(
            f"{name} moves KV with --kv-transport {theirs_t} but {ref_name} with --kv-transport {ours_t}: a prefill "
            f"worker can hand KV only to a decode worker of the same transport. Fix: start every worker with "
            f"--kv-transport {ours_t}, or every worker with --kv-transport {theirs_t}.")


def _check_pool(name: str, card: WorkerCard, window: int) -> None:
    pool = card.pool_tokens
    if pool < window:
        raise CapacityMismatch(
            f"{name}: its KV pool holds {pool} tokens, fewer than the {window}-token context window the "
            f"router is to serve. A prompt between the two would not fit on that worker. Fix: raise that "
            f"worker's pool to at least {window} tokens (--kv-pool-tokens {window}), or lower the served "
            f"window to at most {pool} tokens (--max-model-len {pool}).")


@dataclass(frozen=True)
class FleetSpec:
    """What every worker must match to get requests: fixed when the router starts."""

    window: int  # the served context window
    agreed: Agreement  # what the fleet the router started with agrees on
    tokenizer_digest: str  # the router's own tokenizer (identity.tokenizer_digest)
    test_faults: str  # the router's own --test-faults, canonical ("" for none)

    @staticmethod
    def of(cards: list[tuple[str, WorkerCard]], window: int, tokenizer_digest: str, test_faults: str) -> FleetSpec:
        return FleetSpec(window, Agreement.of(cards[0][1]), tokenizer_digest, test_faults)


def check_worker(name: str, role: Role, card: WorkerCard, spec: FleetSpec, capacity: bool = True) -> None:
    """Raise CapacityMismatch unless this worker may serve in the fleet `spec` describes, in the role `role`.
    capacity=False (the test-only incident fault) skips the window checks only."""
    if card.role != role:
        raise CapacityMismatch(f"{name} is a {card.role!r} worker, not a {role!r} one. Fix: give its "
                               f"endpoint as --{card.role} (or start it as `kvseal {role}`).")
    if (card.reservation_timeout_s is None) != (role != Role.DECODE):
        raise CapacityMismatch(f"{name}: a {role} worker that reports reservation_timeout_s="
                               f"{card.reservation_timeout_s!r}; only a decode worker holds reservations, and every "
                               f"one does. Fix: run one kvseal version on the router and every worker.")
    _check_agree("the fleet", spec.agreed, name, Agreement.of(card))
    if capacity:
        _check_pool(name, card, spec.window)
    window = card.context_window
    if capacity and window < spec.window:
        raise CapacityMismatch(
            f"{name}: it serves a context window of {window} tokens, smaller than the {spec.window}-token window "
            f"the router serves. A prompt between the two would be refused there. Fix: start that worker with "
            f"--max-model-len {spec.window} (or without --max-model-len), or serve at most {window} tokens "
            f"(--max-model-len {window} on the router).")
    if card.tokenizer_digest != spec.tokenizer_digest:
        raise CapacityMismatch(
            f"{name} has tokenizer {card.tokenizer_digest} but the router has {spec.tokenizer_digest}: the "
            f"router would tokenize prompts for another vocabulary. Fix: start the router and every worker with "
            f"the same model.")
    if card.test_faults != spec.test_faults:
        theirs, ours = card.test_faults or "none", spec.test_faults or "none"
        raise CapacityMismatch(
            f"{name} runs with test faults {theirs!r} but the router with {ours!r}: a fleet is all-clean or all "
            f"on the same test faults. Fix: start every process with the same --test-faults (or none).")
