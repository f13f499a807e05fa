"""Break each seal on purpose and check that its tests fail. The working tree is never touched.

    .venv/bin/python scripts/prove_seals.py            # the fast (unit) mutations
    .venv/bin/python scripts/prove_seals.py --all      # also the ones that need real processes
    .venv/bin/python scripts/prove_seals.py --check    # only: does every snippet still match, exactly once?

Each mutation replaces one snippet of source with a broken version in a fresh copy of the tree (a temporary
directory, removed afterwards), runs the named tests there, and expects them to FAIL. A crash or Ctrl-C can leave at
most a stray temporary directory, never a mutated working tree. Exit 1 if any mutation survived, or if a snippet
no longer matches its file exactly once (the code moved on: update the entry, never delete a seal's proof).

`make test` runs all of it: tests/unit/test_seal_proofs.py checks every snippet and test name in a second, and
tests/integration/test_seal_proofs.py runs every mutation, with the smallest test selection that catches each.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# without git: everything but these (build/ holds the image's wheels, 330 MB: copied 44 times it was most of the run)
_SKIP = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "*.pyc",
                               ".hypothesis", "build", "bench_out", "*.egg-info", ".whl")

# (seal, file, original snippet, broken snippet, tests, needs real processes)
MUTATIONS = [
    ("1 one terminal state", "kvseal/lifecycle.py",
     "        if self.terminal:\n            return False\n        self.outcome = outcome",
     "        self.outcome = outcome",
     ["tests/unit/test_lifecycle.py"], False),
    ("2 no stand-ins (finish only from DECODING)", "kvseal/lifecycle.py",
     "        if self.state is not State.DECODING:\n            raise IllegalTransition",
     "        if False:\n            raise IllegalTransition",
     ["tests/unit/test_lifecycle.py"], False),
    ("5 owned pages only", "kvseal/engine/runner.py",
     "        return [s for s, n in zip(batch.seqs, batch.num_new) if not self._may_run(s, n)]",
     "        return []",
     ["tests/unit/test_engine.py::test_seal5_foreign_page_fails_only_that_request"], False),
    ("5+9 a cached page only under the request's own tenant key", "kvseal/kv/allocator.py",
     "                and self._cache.holds(owner, namespace, rest.tolist()))",
     "                )",
     ["tests/unit/test_engine_prefix.py::test_seal5_another_tenants_cached_page_is_refused"], False),
    ("5 a sliding-window table names only the request's own pages", "kvseal/engine/runner.py",
     "\n                and (self.window is None or self.window.owns(seq)))",
     ")",
     ["tests/unit/test_window_pages.py::test_seal5_a_window_table_naming_another_requests_page_fails_only_that_request"],
     False),
    ("6 a page dropped from a sliding window is scrubbed as it leaves", "kvseal/kv/window.py",
     "        self.pool.scrub(pages)\n",
     "        pass\n",
     ["tests/unit/test_window_pages.py::test_a_long_sequence_keeps_only_its_window_and_each_dropped_page_is_scrubbed_and_freed"],
     False),
    ("8 a sliding window's pages are freed when its request ends", "kvseal/kv/window.py",
     "        self.allocator.free_all(seq.owner.key)\n",
     "        pass\n",
     ["tests/unit/test_window_pages.py::test_a_long_sequence_keeps_only_its_window_and_each_dropped_page_is_scrubbed_and_freed"],
     False),
    ("5+6 a cached page is never written", "kvseal/engine/runner.py",
     " and self.allocator.owns(seq.owner, written)",
     "",
     ["tests/unit/test_engine_prefix.py::test_seal5_a_step_that_would_write_into_a_cached_page_is_refused"], False),
    ("9 the cache is keyed by tenant", "kvseal/engine/engine.py",
     "        root = namespace_root(req.tenant, req.cache_salt)",
     "        root = namespace_root('', None)",
     ["tests/unit/test_engine_prefix.py::test_tenants_and_salts_never_share"], False),
    ("9 cache_salt only splits a tenant's cache (the root is length-prefixed, never a plain join)",
     "kvseal/kv/prefix_cache.py",
     ('    parts = [b"kvseal-prefix-v1", len(t).to_bytes(4, "little"), t]\n    if cache_salt is not None:\n'
     '        s = cache_salt.encode("utf-8", "surrogatepass")\n        parts += [b"\\x01", len(s).to_bytes(4, "little"), s]\n'
     '    else:\n        parts.append(b"\\x00")\n'),
     '    parts = [b"kvseal-prefix-v1", (tenant + (cache_salt or "")).encode("utf-8", "surrogatepass")]\n',
     ["tests/unit/test_engine_prefix.py::test_a_crafted_salt_never_reaches_another_tenants_pages"], False),
    ("6+8 cached pages: referenced never evicted, scrubbed when evicted", "kvseal/kv/prefix_cache.py",
     "            self._lru.pop(p, None)",
     "            pass",
     ["tests/unit/test_prefix_cache.py"], False),
    ("6 freed pages are empty", "kvseal/engine/engine.py",
     "scrubber=self._scrub if cfg.cache.scrub else None",
     "scrubber=None",
     ["tests/unit/test_engine.py::test_seal6_freed_pages_are_zeroed"], False),
    ("8 nothing leaks (pages freed at the end)", "kvseal/engine/scheduler.py",
     "        self.allocator.free_all(seq.owner.key)\n",
     "        pass\n",
     ["tests/unit/test_engine.py"], False),
    ("8 allocator refuses foreign frees", "kvseal/kv/allocator.py",
     "        if not self.owns(owner, pages):\n            raise NotOwner",
     "        if False:\n            raise NotOwner",
     ["tests/unit/test_allocator.py"], False),
    ("4 verify before use (engine, stateful)", "kvseal/engine/kv_decode.py",
     "            if check:\n                verify(manifest, res, pages,",
     "            if False:\n                verify(manifest, res, pages,",
     ["tests/unit/test_handoff_stateful.py", "tests/unit/test_peer_frames.py"], False),
    ("3+8 a released reservation frees its pages", "kvseal/engine/kv_reserve.py",
     "        self.engine.end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))",
     "        seq.life.reject(error) if rejected else seq.life.fail(error)",
     ["tests/unit/test_handoff_stateful.py"], False),
    ("4 verify before use", "kvseal/worker/decode.py",
     "lambda: self.kv.take_in(a, self.hooks.verify_kv())",
     "lambda: self.kv.take_in(a, False)",
     ["tests/integration/test_disagg_handoff.py::test_decode_refuses_kv_that_is_not_what_it_reserved[zmq-False-flip_byte]"],
     True),
    ("4 verify before use (KV that landed in the reserved pages over NIXL)", "kvseal/transfer/verify.py",
     "        sums = pool_checksums(pages.k, pages.v, pages.page_ids)",
     "        sums = list(manifest.page_checksums)",
     ["tests/unit/test_landing.py::test_a_page_that_landed_wrong_fails_the_request_and_is_scrubbed"], False),
    ("4 nothing lands unless the manifest names the reservation (NIXL claim)", "kvseal/engine/kv_decode.py",
     "            if check:\n                verify_identity(",
     "            if False:\n                verify_identity(",
     ["tests/unit/test_landing.py::test_a_claim_that_names_the_reservation_but_does_not_match_it_fails_the_request"],
     False),
    ("4 a forged arrival (wrong reservation id or nonce) is dropped, the live request unharmed", "kvseal/engine/kv_decode.py",
     "        if err.field in NAMES and seq.life.state is State.RESERVED:\n            return",
     "        if False:\n            return",
     ["tests/unit/test_landing.py::test_a_claim_that_does_not_name_the_reservation_moves_nothing_and_harms_nothing"],
     False),
    ("4 a NIXL offer is range-checked before the claim", "kvseal/transfer/nixl.py",
     "        bad = check_offer(offer, manifest, self._geo)",
     "        bad: list[str] = []",
     ["tests/integration/test_nixl_offers.py::test_an_offer_out_of_range_is_refused_before_the_claim_and_harms_nothing"],
     False),
    ("4 a NIXL offer's regions fit the address space", "kvseal/transfer/nixl_offer.py",
     "        if not 0 < addr <= ADDRESS_SPACE - span:",
     "        if False:",
     ["tests/unit/test_nixl_offer.py"], False),
    ("4+6+8 quarantine until the NIXL read is over (never freed on a timer)", "kvseal/transfer/nixl_reads.py",
     "            if state in (\"DONE\", \"ERR\"):\n                return self._ended(tid, state)",
     "            if state in (\"DONE\", \"ERR\") or now >= r.deadline:\n                return self._ended(tid, state)",
     ["tests/integration/test_nixl_late_reads.py::test_a_read_past_its_deadline_keeps_its_pages_until_nixl_says_it_is_over"],
     True),
    ("9 a decode worker reads only its own offers (partial NIXL metadata)", "kvseal/transfer/nixl_window.py",
     "agent.get_partial_agent_metadata(self._descs, True)",
     "agent.get_agent_metadata()",
     ["tests/integration/test_nixl_offers.py::test_a_decode_worker_reads_only_the_pages_it_was_offered_while_the_offer_lives"],
     False),
    ("6 an export window page is zeroed when its offer ends", "kvseal/transfer/nixl_window.py",
     "                blocks[:, start:start + n].zero_()",
     "                pass",
     ["tests/integration/test_nixl_offers.py::test_a_decode_worker_reads_only_the_pages_it_was_offered_while_the_offer_lives"],
     False),
    ("4+8 pages stay pinned while bytes may land (NIXL)", "kvseal/engine/kv_decode.py",
     "        return seq.landing  # bytes may still land",
     "        return False  # bytes may still land",
     ["tests/unit/test_landing.py::test_pages_stay_pinned_while_bytes_may_land_even_when_the_request_ends"], False),
    ("3 reject before transfer (router window check)", "kvseal/api/routes/generate.py",
     "    if len(ids) + max_tokens > window:",
     "    if False:",
     ["tests/unit/test_window_check.py"], False),
    ("3 a prefill refusal releases the reservation", "kvseal/router/disagg_request.py",
     "        if self.decode is not None:\n            await _safe_notify(self.decode, P.ReleaseReq(",
     "        if False:\n            await _safe_notify(self.decode, P.ReleaseReq(",
     ["tests/integration/test_disagg_handoff.py::test_prefill_refusal_reaches_client_with_its_error_and_moves_nothing[zmq]"],
     True),
    # the one pool check behind both the start-up check (check_fleet) and every join (check_worker)
    ("7 capacity holds everywhere", "kvseal/router/registry.py",
     "    if pool < window:",
     "    if False:",
     ["tests/unit/test_registry.py"], False),
    # issue 22: the KV spec (wire/kvspec.py) is compared as one struct, field by field; every field still counts
    ("4 the manifest's KV spec must equal the reservation's (fingerprint, page size, dtype, layout)",
     "kvseal/transfer/verify.py",
     "    differ = r.kv.differences(m.kv)\n",
     "    differ: list[tuple[str, object, object]] = []\n",
     ["tests/unit/test_manifest.py::test_verify_refuses_each_mismatch"], False),
    ("7 the fleet agrees on the KV spec, kernels and arithmetic (the worker card's fields)",
     "kvseal/router/registry.py",
     "    differ = ref.differences(agreement)\n",
     "    differ: list[tuple[str, object, object]] = []\n",
     ["tests/unit/test_registry.py::test_a_worker_that_differs_in_any_field_is_refused"], False),
    ("4 the first token is range-checked", "kvseal/transfer/verify.py",
     "        _check_first_token(m, vocab_size, logprobs)",
     "        pass",
     ["tests/unit/test_peer_frames.py"], False),
    # a request's state lives on its Sequence (issues 22, 31): leaving `requests` at its end is what leaves nothing
    ("1 after fail_all no reservation is left for a late arrival (an ended request leaves the engine's one home)",
     "kvseal/engine/engine.py",
     "            self.scheduler.remove(seq)\n            self.requests.drop(seq)",
     "            self.scheduler.remove(seq)",
     ["tests/unit/test_peer_frames.py"], False),
    ("7 capacity holds at every join", "kvseal/router/workers.py",
     "                self.check(self, resp.card)\n",
     "                pass\n",
     ["tests/integration/test_fleet_join.py::test_a_restarted_worker_with_a_small_pool_stays_out_loudly"], True),
    ("7 the model fingerprint covers every tensor's bytes (not only names, types and shapes)",
     "kvseal/model/file_index.py",
     "t.tensor_type.name, list(t.shape), self.tensor_digests[t.name]]",
     "t.tensor_type.name, list(t.shape)]",
     ["tests/unit/test_loaders.py::test_gguf_fingerprint_stable_and_distinct"], False),
    ("7+10 a weights cache file serves only the weights it was built for (its key is checked)",
     "kvseal/model/weight_cache.py",
     "        if meta.get(\"key\") != key:\n",
     "        if False:\n",
     ["tests/unit/test_weight_cache.py::test_corrupt_cache_is_rebuilt"], False),
    ("9 a worker's frames reach only the requests it serves (the router's one home hands them over)",
     "kvseal/router/disagg_request.py",
     "        if w is not self.decode or not self._streaming:",
     "        if not self._streaming:",
     ["tests/unit/test_router_frames.py::test_only_the_requests_own_workers_frames_reach_it"], False),
    ("1 no silent holes (the router checks delta numbers)", "kvseal/router/disagg_request.py",
     "        if msg.seq != want:",
     "        if False:",
     ["tests/integration/test_stream_holes.py::test_a_lost_delta_fails_the_request_instead_of_a_200_with_text_missing"],
     True),
    ("5 owned pages only (fast attention reads no page outside the pool)", "kvseal/kernels/attention.c",
     "            if (tables[off + i] < 0 || tables[off + i] >= P) return -3;",
     "            if (0) return -3;",
     ["tests/unit/test_fast_kernels.py::test_attention_refuses_pages_outside_the_pool_and_spans_past_their_table"],
     False),
    ("5 owned pages only (the fast one-call step writes only the rows' own slots)", "kvseal/kernels/forward.c",
     "            if (pos[t] != p || p >= max_pos || slots[t] != tables[sp[3] + p / S] * S + p % S) return -3;",
     "            if (pos[t] != p || p >= max_pos) return -3;",
     ["tests/e2e/test_fast_arithmetic.py::test_a_bad_span_is_refused_before_any_kv_is_written"], True),
    ("10 fast arithmetic is batch invariant (a faster path summing in another order)", "kvseal/kernels/attention.c",
     "        for (int t = 0; t < KB; t++) {                                                                          \\\n            P##_v vv[4];",
     "        for (int t = KB - 1; t >= 0; t--) {                                                                     \\\n            P##_v vv[4];",
     ["tests/unit/test_fast_kernels.py::test_attention_is_the_same_however_the_prompt_is_chunked_or_batched"],
     False),
    # torch kernels (the native ones rotate in C): the rotation turned the other way, a sign convention slip. Caught
    # against transformers' own rotary embedding in a second; tests/e2e/test_correctness.py catches it too, in
    # minutes (the tiny random models of test_hf_tiny do not: their argmax does not move)
    ("10 outputs are right", "kvseal/model/rope.py",
     "    return x * cos[:, None, :] + rotated * sin[:, None, :]",
     "    return x * cos[:, None, :] - rotated * sin[:, None, :]",
     ["tests/unit/test_rope_reference.py"], False),
    # issue 17: only fleet members talk to the fleet (seals 9, 7, 4 hold only among members)
    ("9+7 auth: a peer off the allow-list is refused at the handshake", "kvseal/auth/keys.py",
     "        if public in self.allowed:\n            return True\n        if self.allowed_dir is None:",
     "        return True\n        if self.allowed_dir is None:",
     ["tests/integration/test_fleet_auth_sockets.py"], False),
    ("9+7 auth: prefill sends KV only to a receiver key on its allow-list", "kvseal/transfer/zmq_dealers.py",
     "        if self.keys is not None and not (server_key and self.keys.admits(server_key)):",
     "        if False:",
     ["tests/integration/test_fleet_auth_sockets.py::test_a_sender_pins_the_receivers_key"], False),
    ("9+7 auth: the fleet socket takes only members (the rogue-worker attack)", "kvseal/router/disagg.py",
     "            as_server(self._fleet_sock, self.keys)\n",
     "",
     ["tests/integration/test_rogue_worker.py"], True),
    ("9+4 auth: a worker's control port takes only members", "kvseal/worker/server.py",
     "        as_server(self.ctrl, keys)\n",
     "",
     ["tests/integration/test_fleet_auth.py::test_a_worker_alone_reads_nothing_a_stranger_sends_to_its_control_port"],
     True),
    ("9 a tenant's /info shows only its own world", "kvseal/api/routes/status.py",
     "    if not is_admin(request):",
     "    if False:",
     ["tests/unit/test_tenant_view.py"], False),
    ("9 a fleet port off loopback needs keys", "kvseal/auth/curve.py",
     "    if not is_loopback(host):",
     "    if False:",
     ["tests/unit/test_fleet_keys.py"], False),
    # issue 30: no shared resource without a tenant partition (docs/seals.md's register)
    ("11 the text pool: no tenant holds more than its share of the threads", "kvseal/tenancy/textpool.py",
     "            if self.running.get(tenant, 0) >= self.per_tenant:\n                continue",
     "            if False:\n                continue",
     ["tests/unit/test_tenant_edge.py::test_one_tenant_filling_the_tokenizer_threads_does_not_hold_up_another"],
     False),
    ("11 a prompt that cannot fit the window is refused before it is tokenized", "kvseal/api/text.py",
     "        if at_least > self.window:",
     "        if False:",
     ["tests/unit/test_tenant_edge.py::test_a_prompt_that_cannot_fit_the_window_is_refused_before_it_is_tokenized"],
     False),
    ("11 every endpoint that does work counts against rpm and max_concurrent", "kvseal/tenancy/ratelimit.py",
     '        if scope["type"] != "http" or scope.get("path") in STATUS_PATHS:',
     '        if scope["type"] != "http" or scope.get("path") != "/v1/completions":',
     ["tests/unit/test_tenant_edge.py::test_tokenize_detokenize_and_stored_responses_count_against_rpm",
      "tests/unit/test_tenant_edge.py::test_a_tokenize_in_flight_counts_against_max_concurrent"], False),
    ("11 a tenant's request bodies in progress have a budget", "kvseal/tenancy/bodylimit.py",
     "        if held + more <= self.tenant_bytes:",
     "        if True:",
     ["tests/unit/test_tenant_edge.py::test_a_tenants_bodies_in_progress_have_a_budget_and_the_other_tenant_keeps_its_own"],
     False),
    ("11 stored responses: each tenant evicts only its own", "kvseal/tenancy/response_store.py",
     'never a pool shared with others."""\n    return tenant',
     'never a pool shared with others."""\n    return ""',
     ["tests/unit/test_response_store.py::test_one_tenant_filling_its_partition_never_evicts_another_tenants_entry",
      "tests/unit/test_response_store.py::test_another_tenants_write_does_not_reveal_its_size_through_evictions"],
     False),
    # issue 34: tenant state shared by several routers in Redis, partitioned and sealed at rest
    ("11 Redis names no tenant in clear", "kvseal/tenancy/sealer.py",
     '        return self._mac(b"tenant\\0" + tenant.encode())',
     "        return tenant",
     ["tests/integration/test_redis_state.py::test_a_stored_response_is_read_through_every_router_and_never_by_another_tenant"],
     True),
    ("11 stored responses are sealed at rest", "kvseal/tenancy/sealer.py",
     "        return nonce + self._aead(tenant).encrypt(nonce, plain, key.encode())",
     "        return nonce + plain",
     ["tests/integration/test_redis_state.py::test_a_stored_response_is_read_through_every_router_and_never_by_another_tenant"],
     True),
    ("11 max_concurrent holds across routers", "kvseal/tenancy/redis_limits.py",
     "  if n >= maxc then return {1, n} end",
     "  if false then return {1, n} end",
     ["tests/integration/test_redis_state.py::test_max_concurrent_holds_across_routers"], True),
    ("11 a live router's places in flight are renewed", "kvseal/tenancy/redis_limits.py",
     "                self._start_renewing()\n",
     "",
     ["tests/integration/test_redis_state.py::test_a_dead_routers_places_free_within_its_lease_and_a_live_routers_are_renewed"],
     True),
    ("11 a request drafts from its own text alone (no index shared between requests)", "kvseal/engine/speculate.py",
     "    lookup: Lookup = field(default_factory=Lookup)",
     "    lookup: Lookup = field(default_factory=lambda shared=Lookup(): shared)",
     ["tests/unit/test_spec_engine.py::test_drafts_are_built_from_each_requests_own_text_alone"], False),
    ("10 a rejected draft's positions are never taken for computed tokens", "kvseal/engine/drafts.py",
     "        seq.num_computed -= rejected",
     "        pass",
     ["tests/unit/test_spec_engine.py::test_drafts_give_the_greedy_tokens_of_decoding_without_them"], False),
    ("6 a draft's rejected pages are scrubbed and freed", "kvseal/engine/scheduler.py",
     "            self.allocator.free(seq.owner, seq.pages[keep:])\n            del seq.pages[keep:]\n",
     "",
     ["tests/unit/test_spec_engine.py::test_drafts_give_the_greedy_tokens_of_decoding_without_them"], False),
    ("11 a worker's metrics port names no tenant to a scrape without the metrics token", "kvseal/metrics/token.py",
     "        if not authorization:\n            return public(environ, start_response)",
     "        if not authorization:\n            return full(environ, start_response)",
     ["tests/unit/test_metrics_token.py::test_a_scrape_without_a_header_names_no_tenant_but_keeps_the_fleet_level_families"],
     False),
    ("11 the fleet-level metrics collector yields no per-tenant family", "kvseal/metrics/engine.py",
     '        info = InfoMetricFamily("kvseal:worker",',
     '        yield from tenant_families(e)\n        info = InfoMetricFamily("kvseal:worker",',
     ["tests/unit/test_metrics_token.py::test_a_scrape_without_a_header_names_no_tenant_but_keeps_the_fleet_level_families"],
     False),
    ("11 only the metrics token unlocks a worker's per-tenant metrics", "kvseal/metrics/token.py",
     "and hmac.compare_digest(given, sha256)",
     "and bool(given)",
     ["tests/unit/test_metrics_token.py::test_a_wrong_token_gets_401_and_no_figures"], False),
]


Mutation = tuple[str, str, str, str, list[str], bool]


@dataclass(frozen=True)
class Result:
    seal: str
    verdict: str  # "caught" | "SURVIVED" | "stale"
    seconds: float
    detail: str


def stale(mutations: Iterable[Mutation], root: Path = ROOT) -> list[str]:
    """Why entries no longer fit the tree: a snippet that does not match its file exactly once, a test file or test
    function that is gone, or a snippet whose broken version is the same text."""
    out = []
    for seal, rel, old, new, tests, _ in mutations:
        path = root / rel
        n = path.read_text().count(old) if path.is_file() else 0
        if n != 1:
            out.append(f"[seal {seal}] snippet found {n} times in {rel}, not exactly once: update this entry")
        if old == new:
            out.append(f"[seal {seal}] the broken snippet is the original")
        for t in tests:
            file, _, name = t.partition("::")
            test_file = root / file
            if not test_file.is_file():
                out.append(f"[seal {seal}] test file {file} is gone")
            elif name and not re.search(rf"^(async )?def {re.escape(name.split('[')[0])}\(", test_file.read_text(),
                                        re.MULTILINE):
                out.append(f"[seal {seal}] test {name} is not in {file}")
    return out


def copy_tree(dst: Path, root: Path = ROOT) -> None:
    """The working tree as git sees it (tracked and untracked files, never ignored ones), edits included."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked source tree)
        shutil.copytree(root, dst, ignore=_SKIP, symlinks=True)
        return
    for rel in filter(None, out.decode("utf-8", "surrogateescape").split("\0")):
        src = root / rel
        if src.is_file() or src.is_symlink():  # a tracked file deleted in the working tree is not copied
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel, follow_symlinks=False)


def run_one(mutation: Mutation, root: Path = ROOT) -> Result:
    """Apply one mutation in a fresh copy of the tree and run its tests there; caught when they fail."""
    seal, rel, old, new, tests, _ = mutation
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvseal-prove-") as tmp:
        copy = Path(tmp) / "tree"
        copy_tree(copy, root)
        path = copy / rel
        src = path.read_text()
        if src.count(old) != 1:
            return Result(seal, "stale", 0.0, f"snippet not found exactly once in {rel}: update this script")
        path.write_text(src.replace(old, new))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])]))
        env["KVSEAL_TEST_READY_TIMEOUT"] = "60"  # a mutation that keeps the fleet from forming fails in 60 s, not 180
        env["KVSEAL_PROVE_SEALS"] = "1"  # tests/conftest.py: hypothesis reports the first failing example unshrunk
        env.pop("PYTEST_ADDOPTS", None)
        env.pop("PYTEST_CURRENT_TEST", None)
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                           cwd=copy, env=env, capture_output=True, text=True, check=False)
    lines = r.stdout.strip().splitlines()
    detail = lines[-1] if lines else r.stderr.strip()[-300:]
    # caught: the tests ran and failed (1); an error collecting or running them (2-5) proves nothing
    verdict = "caught" if r.returncode == 1 else "SURVIVED"
    if r.returncode not in (0, 1):
        detail = f"pytest exited {r.returncode} (not a test failure): {detail}"
    return Result(seal, verdict, time.monotonic() - start, detail)


def run(mutations: Sequence[Mutation], root: Path = ROOT, echo: bool = True, jobs: int = 1) -> list[Result]:
    """Every mutation, `jobs` at a time (each in its own copy of the tree); results in the order given."""
    def one(m: Mutation) -> Result:
        res = run_one(m, root)
        if echo:
            print(f"[seal {res.seal}] {m[1]}: {res.verdict} in {res.seconds:.0f}s ({res.detail})", flush=True)
        return res

    # the longest first (a kernel rebuilt in the copy, real processes started), so the jobs end together
    order = sorted(range(len(mutations)), key=lambda i: -_expected_cost(mutations[i]))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        done = dict(zip(order, pool.map(one, [mutations[i] for i in order])))
    return [done[i] for i in range(len(mutations))]


def _expected_cost(m: Mutation) -> int:
    """A rough rank of a mutation's run time: C kernels rebuild (slowest), then tests that start processes."""
    return 2 * m[1].endswith(".c") + any(t.startswith(("tests/integration", "tests/e2e")) for t in m[4])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="include mutations whose tests start real processes")
    ap.add_argument("--only", default="", help="run only the mutations whose seal label contains this")
    ap.add_argument("--check", action="store_true", help="only check that every entry still fits the tree")
    ap.add_argument("--jobs", type=int, default=1, help="mutations to run at once (each in its own copy)")
    args = ap.parse_args()
    problems = stale(MUTATIONS)
    for p in problems:
        print(p)
    if args.check or problems:
        print("every snippet matches exactly once" if not problems else "update this script")
        return 1 if problems else 0
    chosen = [m for m in MUTATIONS if (args.all or not m[5]) and args.only in m[0]]
    survived = [r.seal for r in run(chosen, jobs=args.jobs) if r.verdict != "caught"]
    print("every mutation was caught" if not survived else f"survived: {survived}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
