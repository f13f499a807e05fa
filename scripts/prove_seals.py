"""Break each seal on purpose and check that its tests fail, then restore the code.

    .venv/bin/python scripts/prove_seals.py            # the fast (unit) mutations
    .venv/bin/python scripts/prove_seals.py --all      # also the ones that need real processes

Each mutation replaces one snippet of source with a broken version, runs the named tests, and expects
them to FAIL. The source is restored afterwards whatever happens. Exit 1 if any mutation survived.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

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
     ["tests/unit/test_engine.py"], False),
    ("5+9 a cached page only under the request's own tenant key", "kvseal/kv/allocator.py",
     "                and self._cache.holds(owner, namespace, rest.tolist()))",
     "                )",
     ["tests/unit/test_engine_prefix.py::test_seal5_another_tenants_cached_page_is_refused"], False),
    ("5+6 a cached page is never written", "kvseal/engine/runner.py",
     " and self.allocator.owns(seq.owner, written)",
     "",
     ["tests/unit/test_engine_prefix.py::test_seal5_a_step_that_would_write_into_a_cached_page_is_refused"], False),
    ("9 the cache is keyed by tenant", "kvseal/engine/engine.py",
     "        root = namespace_root(req.tenant, req.cache_salt)",
     "        root = namespace_root('', None)",
     ["tests/unit/test_engine_prefix.py::test_tenants_and_salts_never_share"], False),
    ("6+8 cached pages: referenced never evicted, scrubbed when evicted", "kvseal/kv/prefix_cache.py",
     "            self._lru.pop(p, None)",
     "            pass",
     ["tests/unit/test_prefix_cache.py"], False),
    ("6 freed pages are empty", "kvseal/engine/engine.py",
     "scrubber=self.pool.scrub if cfg.cache.scrub else None",
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
    ("4 verify before use (engine, stateful)", "kvseal/engine/disagg.py",
     "            if check:\n                verify(",
     "            if False:\n                verify(",
     ["tests/unit/test_handoff_stateful.py", "tests/unit/test_peer_frames.py"], False),
    ("3+8 a released reservation frees its pages", "kvseal/engine/disagg.py",
     "        self._end(seq, lambda: seq.life.reject(error) if rejected else seq.life.fail(error))",
     "        seq.life.reject(error) if rejected else seq.life.fail(error)",
     ["tests/unit/test_handoff_stateful.py"], False),
    ("4 verify before use", "kvseal/worker/decode.py",
     "                self.dengine.accept(a.manifest, a.payload, check=self.hooks.verify_kv())",
     "                self.dengine.accept(a.manifest, a.payload, check=False)",
     ["tests/integration/test_disagg_handoff.py::test_decode_refuses_kv_that_is_not_what_it_reserved"], True),
    ("4 verify before use (KV that landed in the reserved pages over NIXL)", "kvseal/engine/disagg.py",
     "            if check:\n                verify_landed(",
     "            if False:\n                verify_landed(",
     ["tests/unit/test_landing.py::test_a_page_that_landed_wrong_fails_the_request_and_is_scrubbed"], False),
    ("4 nothing lands unless the manifest names the reservation (NIXL claim)", "kvseal/engine/disagg.py",
     "            if check:\n                verify_identity(",
     "            if False:\n                verify_identity(",
     ["tests/unit/test_landing.py::test_a_claim_that_names_the_reservation_but_does_not_match_it_fails_the_request"],
     False),
    ("4 a forged arrival (wrong reservation id or nonce) is dropped, the live request unharmed", "kvseal/engine/disagg.py",
     "        if check:\n            verify_names(manifest, res)",
     "        if False:\n            verify_names(manifest, res)",
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
    ("4+6+8 quarantine until the NIXL read is over (never freed on a timer)", "kvseal/transfer/nixl.py",
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
     "        self.k.index_fill_(1, idx, 0)\n        self.v.index_fill_(1, idx, 0)",
     "        pass",
     ["tests/integration/test_nixl_offers.py::test_a_decode_worker_reads_only_the_pages_it_was_offered_while_the_offer_lives"],
     False),
    ("4+8 pages stay pinned while bytes may land (NIXL)", "kvseal/engine/disagg.py",
     "        if seq.request_id not in self.landing:",
     "        if True:",
     ["tests/unit/test_landing.py::test_pages_stay_pinned_while_bytes_may_land_even_when_the_request_ends"], False),
    ("3 reject before transfer (router window check)", "kvseal/router/routes/generate.py",
     "        if len(ids) + max_tokens > window:",
     "        if False:",
     ["tests/integration/test_disagg_incident.py::test_window_lowered_to_fit_rejects_before_any_worker"], True),
    ("3 a prefill refusal releases the reservation", "kvseal/router/disagg.py",
     "            if decode is not None:\n                await self._safe_notify(decode, P.ReleaseReq(",
     "            if False:\n                await self._safe_notify(decode, P.ReleaseReq(",
     ["tests/integration/test_disagg_handoff.py::test_prefill_refusal_reaches_client_with_its_error_and_moves_nothing"],
     True),
    ("7 capacity holds everywhere", "kvseal/router/disagg.py",
     "            check_fleet(infos, self.context_window)",
     "            pass",
     ["tests/integration/test_disagg_incident.py::test_router_refuses_to_start_when_a_pool_is_smaller_than_the_window"],
     True),
    ("4 the first token is range-checked", "kvseal/transfer/manifest.py",
     "        _check_first_token(m, vocab_size, logprobs)",
     "        pass",
     ["tests/unit/test_peer_frames.py"], False),
    ("1 after fail_all no reservation is left for a late arrival", "kvseal/engine/engine.py",
     "            self._forget(seq.request_id)\n            self._end(seq, partial(seq.life.fail, error))",
     "            self._end(seq, partial(seq.life.fail, error))",
     ["tests/unit/test_peer_frames.py"], False),
    ("7 capacity holds at every join", "kvseal/router/workers.py",
     "                self.check(self, info)\n",
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
    ("1 no silent holes (the router checks delta numbers)", "kvseal/router/workers.py",
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
    ("10 outputs are right", "kvseal/model/rope.py",
     "    return x * cos[:, None, :] + rotated * sin[:, None, :]",
     "    return x * cos[:, None, :] + rotated * sin[:, None, :] * 0.999",
     ["tests/e2e/test_correctness.py::test_greedy_alone_equals_transformers"], True),
    # issue 17: only fleet members talk to the fleet (seals 9, 7, 4 hold only among members)
    ("9+7 auth: a peer off the allow-list is refused at the handshake", "kvseal/auth/keys.py",
     "        if public in self.allowed:\n            return True\n        if self.allowed_dir is None:",
     "        return True\n        if self.allowed_dir is None:",
     ["tests/integration/test_fleet_auth_sockets.py"], False),
    ("9+7 auth: prefill sends KV only to a receiver key on its allow-list", "kvseal/transfer/zmq.py",
     "            if self.keys is not None and not (server_key and self.keys.admits(server_key)):",
     "            if False:",
     ["tests/integration/test_fleet_auth_sockets.py::test_a_sender_pins_the_receivers_key"], False),
    ("9+7 auth: the fleet socket takes only members (the rogue-worker attack)", "kvseal/router/disagg.py",
     "            as_server(self._fleet_sock, self.keys)\n",
     "",
     ["tests/integration/test_rogue_worker.py"], True),
    ("9+4 auth: a worker's control port takes only members", "kvseal/worker/server.py",
     "        as_server(self.ctrl, keys)\n",
     "",
     ["tests/integration/test_fleet_auth.py::test_strangers_get_nothing_from_the_control_and_kv_ports"], True),
    ("9 a tenant's /info shows only its own world", "kvseal/router/routes/status.py",
     "    if not is_admin(request):",
     "    if False:",
     ["tests/unit/test_tenant_view.py"], False),
    ("9 a fleet port off loopback needs keys", "kvseal/auth/curve.py",
     "    if not is_loopback(host):",
     "    if False:",
     ["tests/unit/test_fleet_keys.py"], False),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="include mutations whose tests start real processes")
    ap.add_argument("--only", default="", help="run only the mutations whose seal label contains this")
    args = ap.parse_args()
    survived = []
    for seal, rel, old, new, tests, slow in MUTATIONS:
        if (slow and not args.all) or args.only not in seal:
            continue
        path = ROOT / rel
        src = path.read_text()
        if src.count(old) != 1:
            print(f"[seal {seal}] snippet not found exactly once in {rel}: update this script")
            survived.append(seal)
            continue
        path.write_text(src.replace(old, new))
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                               cwd=ROOT, capture_output=True, text=True)
        finally:
            path.write_text(src)
        verdict = "caught" if r.returncode != 0 else "SURVIVED"
        print(f"[seal {seal}] {rel}: {verdict} ({r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ''})")
        if r.returncode == 0:
            survived.append(seal)
    print("every mutation was caught" if not survived else f"survived: {survived}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
