"""Tenant state shared by several routers in a real Redis on loopback (tenancy/redis_*.py, issue 34): each "router"
here is a TenantState built by build_state from the same --state, exactly as three router processes build theirs.

- rpm and max_concurrent hold across the routers together; a dead router's places free within its lease, a live
  router's are renewed;
- a stored response written through one router is read through the others, never by another tenant, and evicts
  only its own tenant's entries;
- Redis's data names no tenant and holds no conversation in clear (the dump is searched for both);
- Redis down: admission fails closed (503), stored responses answer 503; Redis back: service recovers by itself.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvseal.config import ServerConfig, TenantPolicy
from kvseal.errors import RateLimited, StateUnavailable
from kvseal.tenancy.limits import Lease
from kvseal.tenancy.state import TenantState, build_state
from tests.helpers.redis_server import RedisServer

pytestmark = pytest.mark.integration

CANARY = "canary-7d41e9-the-secret-plan"
POLICIES = {"acme": TenantPolicy(rpm=60), "globex": TenantPolicy(max_concurrent=2),
            "tiny": TenantPolicy(store_mb=0.004)}


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    s = RedisServer()
    yield s
    s.close()


@pytest.fixture
def secret(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(os.urandom(32).hex().encode())
    return str(path)


def routers(server: RedisServer, secret: str, n: int = 3, lease_s: float = 30.0) -> list[TenantState]:
    server.client().flushall()
    cfg = ServerConfig(state=server.url, state_password_file=str(server.password_file), state_secret_file=secret,
                       state_lease_s=lease_s)
    return [build_state(cfg, POLICIES) for _ in range(n)]


async def closed(states: list[TenantState]) -> None:
    for s in states:
        await s.close()


def test_rpm_holds_across_three_routers_within_one_request(server: RedisServer, secret: str) -> None:
    async def main() -> int:
        rs = routers(server, secret)
        admitted = 0
        for i in range(90):
            try:
                await rs[i % 3].limits.release(await rs[i % 3].limits.admit("acme"))
                admitted += 1
            except RateLimited as err:
                assert err.type == "requests" and err.retry_after_s and err.retry_after_s > 0
        await closed(rs)
        return admitted

    assert 60 <= asyncio.run(main()) <= 61  # a minute's worth, plus at most what refills during the test


def test_max_concurrent_holds_across_routers(server: RedisServer, secret: str) -> None:
    async def main() -> None:
        r1, r2, r3 = rs = routers(server, secret)
        a, b = await r1.limits.admit("globex"), await r2.limits.admit("globex")
        with pytest.raises(RateLimited, match="concurrent"):
            await r3.limits.admit("globex")
        await r1.limits.release(a)
        await r3.limits.release(await r3.limits.admit("globex"))
        await r2.limits.release(b)
        await closed(rs)

    asyncio.run(main())


def test_a_dead_routers_places_free_within_its_lease_and_a_live_routers_are_renewed(server: RedisServer,
                                                                                      secret: str) -> None:
    async def main() -> None:
        live, dead, other = routers(server, secret, lease_s=1.0)
        held = [await live.limits.admit("globex")]
        await dead.limits.admit("globex")
        await dead.close()  # killed: it never releases nor renews its place
        with pytest.raises(RateLimited):
            await other.limits.admit("globex")
        await asyncio.sleep(3.0)  # three leases: the dead one's place is gone, the live one's renewed
        held.append(await other.limits.admit("globex"))
        with pytest.raises(RateLimited):  # the live router's place still counts
            await other.limits.admit("globex")
        for lease, r in zip(held, (live, other)):
            await r.limits.release(lease)
        await closed([live, other])

    asyncio.run(main())


def test_a_stored_response_is_read_through_every_router_and_never_by_another_tenant(server: RedisServer,
                                                                                   secret: str) -> None:
    async def main() -> None:
        r1, r2, r3 = rs = routers(server, secret)
        turn = [{"role": "user", "content": CANARY}]
        assert await r1.responses.put("acme", "resp_1", turn, {"id": "resp_1", "text": CANARY})
        for r in (r2, r3):
            found = await r.responses.get("acme", "resp_1")
            assert found is not None and found.conversation == turn and found.body["text"] == CANARY
            assert await r.responses.get("globex", "resp_1") is None
            assert not await r.responses.delete("globex", "resp_1")
        dump = server.dump()
        for secret_text in (CANARY.encode(), b"acme", b"globex", b"resp_1"):
            assert secret_text not in dump, secret_text  # no conversation, no tenant name, no id in clear
        assert await r3.responses.delete("acme", "resp_1") and await r1.responses.get("acme", "resp_1") is None
        await closed(rs)

    asyncio.run(main())


def test_a_tenant_filling_its_partition_evicts_only_its_own(server: RedisServer, secret: str) -> None:
    async def main() -> None:
        r1, r2, _ = rs = routers(server, secret)
        await r1.responses.put("acme", "theirs", [{"role": "user", "content": "hi"}], {})
        for i in range(30):  # tiny's budget is 4 kB: these overflow it many times
            await r2.responses.put("tiny", f"t{i}", [{"role": "user", "content": "x" * 400}], {})
        assert await r1.responses.get("acme", "theirs") is not None
        kept = [i for i in range(30) if await r1.responses.get("tiny", f"t{i}") is not None]
        assert kept and kept == list(range(30 - len(kept), 30)) and len(kept) < 30  # its newest, within budget
        await closed(rs)

    asyncio.run(main())


def test_an_entry_moved_to_another_tenants_key_does_not_open(server: RedisServer, secret: str) -> None:
    async def main() -> None:
        (r1,) = rs = routers(server, secret, n=1)
        await r1.responses.put("acme", "resp_a", [{"role": "user", "content": CANARY}], {})
        await r1.responses.put("globex", "resp_g", [{"role": "user", "content": "theirs"}], {})
        c = server.client()
        sealer = r1.responses.sealer  # type: ignore[attr-defined]
        a_key, g_key = (f"kvseal:resp:{sealer.entry_of(t, rid)}" for t, rid in (("acme", "resp_a"),
                                                                               ("globex", "resp_g")))
        c.set(g_key, c.get(a_key) or b"")  # someone with write access to Redis swaps in acme's entry
        assert await r1.responses.get("globex", "resp_g") is None  # it does not open as globex's
        await closed(rs)

    asyncio.run(main())


@pytest.mark.serial  # stops and restarts the module's Redis
def test_redis_down_fails_closed_and_service_recovers_by_itself(server: RedisServer, secret: str) -> None:
    async def main() -> None:
        (r1,) = rs = routers(server, secret, n=1)
        await r1.limits.release(await r1.limits.admit("acme"))
        server.stop()
        try:
            for tenant in ("acme", "globex"):
                with pytest.raises(StateUnavailable):
                    await r1.limits.admit(tenant)  # never served unlimited
            with pytest.raises(StateUnavailable):
                await r1.responses.get("acme", "resp_1")
            lease = Lease("acme")
            await r1.limits.release(lease)  # a release that cannot reach Redis is dropped, not raised
            assert (await r1.limits.admit("nolimits")).tenant == "nolimits"  # a tenant without limits needs none
        finally:
            server.start()
        for _ in range(50):  # the client reconnects by itself
            try:
                await r1.limits.release(await r1.limits.admit("acme"))
                break
            except StateUnavailable:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("admission did not recover after Redis came back")
        await closed(rs)

    asyncio.run(main())
