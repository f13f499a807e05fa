"""Router, prefill and decode on three "hosts": Linux network namespaces joined by veth links.

    test process (root ns) --veth 10.231.H.0/24-- router ns --veth 10.231.1.0/24-- prefill ns
                                                     |                                |
                                               veth 10.231.2.0/24          veth 10.231.3.0/24 (KV)
                                                     |                                |
                                                  decode ns -------------------------+

Control traffic goes router<->prefill and router<->decode; the KV pages go prefill->decode over their own
link, to decode's --kv-host. A greedy request works end to end; then the prefill<->decode link is cut while
a long prompt is being prefilled, so its KV cannot arrive: the client gets a well-formed 502/504 (never a
200), both pools return to baseline after the (short) timeouts, and once the link is back requests succeed
again. Everything is set up and torn down here; the test skips only where the kernel refuses a namespace.
Both KV transports run it: ZeroMQ over TCP, and NIXL over UCX limited to TCP on the KV link (UCX_TLS=tcp,
UCX_NET_DEVICES the KV veth), decode reading prefill's pages across the namespaces.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from kvseal.auth.keys import write_key_set
from tests.helpers.procs import Proc, wait_until
from tests.helpers.transports import KV_TRANSPORTS

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
MODEL = "SmolLM2-135M-Instruct"
ENGINE = ["--max-model-len", "1024", "--kv-pool-tokens", "2048", "--threads", "1", "--log-level", "info"]
PREFILL_PORT, DECODE_PORT, KV_PORT, ROUTER_PORT = 7101, 7102, 7103, 8100


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Reachability without ping: a TCP connect to a closed port is refused (RST) when the host is reachable
# and times out (or finds no route) when it is not.
PROBE = ("import socket, sys\n"
         "try:\n    socket.create_connection((sys.argv[1], 9), timeout=2).close()\n"
         "except ConnectionRefusedError:\n    pass\n")


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        why = r.stderr.strip() or r.stdout.strip()
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {why}")
    return r


class NsProc(Proc):
    """`ip netns exec NS python -m kvseal ...`, with Proc's log file, waits and process-group stop."""

    def __init__(self, ns: str, args: list[str], env: dict[str, str] | None = None) -> None:
        # Proc.__init__ is not reused: it runs no prefix
        self.log = tempfile.NamedTemporaryFile(prefix=f"kvseal-{ns}-", suffix=".log",  # noqa: SIM115
                                               delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "kvseal", *args],
                                  stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  cwd=REPO)

    def wait_line(self, text: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.p.poll() is not None:
                raise RuntimeError(f"exited with {self.p.returncode}:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} within {timeout}s:\n{self.output()[-4000:]}")
            time.sleep(0.2)


@dataclass
class Hosts:
    tag: str
    ns: dict[str, str] = field(default_factory=dict)  # role -> namespace name
    links: list[tuple[str, str]] = field(default_factory=list)  # (namespace or "", device) we created
    host_net: int = 0  # X of 10.231.X.0/24, the root namespace <-> router link
    kv_devs: tuple[str, str] = ("", "")  # the prefill<->decode veth: (prefill end, decode end)
    procs: list[NsProc] = field(default_factory=list)

    @property
    def router_url(self) -> str:
        return f"http://10.231.{self.host_net}.2:{ROUTER_PORT}"

    def in_ns(self, role: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh("ip", "netns", "exec", self.ns[role], *cmd, check=check)

    def reaches(self, role: str, addr: str) -> bool:
        return self.in_ns(role, sys.executable, "-c", PROBE, addr, check=False).returncode == 0

    def link(self, a: str, a_addr: str, b: str, b_addr: str, net: int) -> tuple[str, str]:
        """A veth pair between roles a and b ("" = the root namespace) on 10.231.net.0/24."""
        dev_a, dev_b = f"{self.tag}{a[:1] or 'h'}{b[:1]}", f"{self.tag}{b[:1]}{a[:1] or 'h'}"
        sh("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        self.links.append(("", dev_a))
        for role, dev, addr in ((a, dev_a, a_addr), (b, dev_b, b_addr)):
            if role:
                sh("ip", "link", "set", dev, "netns", self.ns[role])
                self.in_ns(role, "ip", "addr", "add", f"10.231.{net}.{addr}/24", "dev", dev)
                self.in_ns(role, "ip", "link", "set", dev, "up")
            else:
                sh("ip", "addr", "add", f"10.231.{net}.{addr}/24", "dev", dev)
                sh("ip", "link", "set", dev, "up")
        return dev_a, dev_b

    def teardown(self) -> None:
        for proc in self.procs:
            proc.stop(timeout=10)
        for ns in self.ns.values():
            sh("ip", "netns", "del", ns, check=False)  # takes its veth ends (and so their peers) along
        for ns, dev in self.links:
            if not ns and sh("ip", "link", "show", dev, check=False).returncode == 0:
                sh("ip", "link", "del", dev, check=False)


def _free_host_net() -> int:
    """A 10.231.X.0/24 for the root-namespace link that nothing on this machine uses yet."""
    used = sh("ip", "-4", "-o", "addr", "show").stdout + sh("ip", "-4", "route", "show").stdout
    for _ in range(100):
        x = 100 + secrets.randbelow(150)
        if f"10.231.{x}." not in used:
            return x
    raise RuntimeError("no free 10.231.X.0/24 for the root namespace link")


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    h = Hosts(tag=f"k{os.getpid() % 10000}{secrets.token_hex(2)}")  # at most 9 chars: device names get 2 more
    probe = f"{h.tag}probe"
    r = sh("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        pytest.skip(f"this kernel refuses network namespaces: `ip netns add {probe}` failed: "
                    f"{r.stderr.strip()}")
    sh("ip", "netns", "del", probe, check=False)
    try:
        for role in ("router", "prefill", "decode"):
            h.ns[role] = f"{h.tag}-{role}"
            sh("ip", "netns", "add", h.ns[role])
            h.in_ns(role, "ip", "link", "set", "lo", "up")
        h.host_net = _free_host_net()
        h.link("", "1", "router", "2", h.host_net)
        h.link("router", "1", "prefill", "2", 1)
        h.link("router", "1", "decode", "2", 2)
        h.kv_devs = h.link("prefill", "1", "decode", "2", 3)
        # each host reaches its peers over their own link, and only those (no routes between the links)
        assert h.reaches("prefill", "10.231.3.2") and h.reaches("decode", "10.231.3.1")
        assert h.reaches("router", "10.231.1.2") and h.reaches("router", "10.231.2.2")
        assert h.reaches("router", f"10.231.{h.host_net}.1")
        assert not h.reaches("router", "10.231.3.2") and not h.reaches("prefill", "10.231.2.2")
        yield h
    finally:
        h.teardown()


@dataclass
class Fleet:
    hosts: Hosts
    prefill: NsProc
    decode: NsProc
    router: NsProc

    def info(self) -> dict[str, Any]:
        return httpx.get(self.hosts.router_url + "/info", timeout=10).json()

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["role"]: w for w in self.info()["workers"]}

    def at_baseline(self) -> bool | dict[str, Any]:
        info = self.info()
        ok = info["live_requests"] == 0 and all(
            w["free_pages"] == w["pool_pages"] and w["running"] == 0 and w["waiting"] == 0
            and w.get("reservations", 0) == 0 for w in info["workers"])
        return ok or info["workers"]

    def worker_info_fresh(self) -> dict[str, dict[str, Any]]:
        """Worker info as the router's heartbeat (every second) reports it: wait two beats for a fresh one."""
        time.sleep(2.5)
        return self.workers()


@pytest.fixture(scope="module", params=KV_TRANSPORTS)
def fleet(hosts: Hosts, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    # off loopback every role needs fleet keys (a worker bound on 10.231.x without them refuses to start)
    keys = tempfile.mkdtemp(prefix="kvseal-netns-keys-")
    write_key_set(keys + "/fleet", ["router", "prefill", "decode"])
    kv = ["--kv-transport", request.param, "--fleet-keys", keys + "/fleet"]

    def ucx(dev: str) -> dict[str, str]:  # NIXL: UCX over TCP on the KV link only, as between hosts
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev} if request.param == "nixl" else {}

    prefill = NsProc(hosts.ns["prefill"], ["prefill", *ENGINE, *kv, "--host", "10.231.1.2",
                                           "--port", str(PREFILL_PORT), "--transfer-timeout", "5"],
                     ucx(hosts.kv_devs[0]))
    decode = NsProc(hosts.ns["decode"], ["decode", *ENGINE, *kv, "--host", "10.231.2.2",
                                         "--port", str(DECODE_PORT), "--kv-host", "10.231.3.2",
                                         "--kv-port", str(KV_PORT), "--reservation-timeout", "8"],
                    ucx(hosts.kv_devs[1]))
    hosts.procs += [prefill, decode]
    prefill.wait_line("worker ready on")
    decode.wait_line("worker ready on")
    router = NsProc(hosts.ns["router"], ["router", "--host", f"10.231.{hosts.host_net}.2",
                                         "--port", str(ROUTER_PORT), "--max-model-len", "1024",
                                         "--fleet-keys", keys + "/fleet",
                                         "--prefill", f"10.231.1.2:{PREFILL_PORT}",
                                         "--decode", f"10.231.2.2:{DECODE_PORT}"])
    hosts.procs.append(router)
    router.wait_http(hosts.router_url + "/health", 300)
    yield Fleet(hosts, prefill, decode, router)
    for proc in (router, prefill, decode):  # the next transport's fleet takes the same ports
        hosts.procs.remove(proc)
        proc.stop(timeout=30)
    shutil.rmtree(keys, ignore_errors=True)


def greedy(fleet: Fleet, timeout: float = 300) -> httpx.Response:
    return httpx.post(fleet.hosts.router_url + "/v1/chat/completions", timeout=timeout, json={
        "model": MODEL, "temperature": 0, "max_tokens": 20,
        "messages": [{"role": "user",
                      "content": "What is the capital of France? Answer in one sentence."}]})


def test_three_hosts_end_to_end(fleet: Fleet) -> None:
    w = fleet.workers()
    assert w["decode"]["kv_endpoint"] == f"tcp://10.231.3.2:{KV_PORT}"  # KV goes over the prefill-decode link
    assert w["decode"]["kv_transport"] == w["prefill"]["kv_transport"]
    r = greedy(fleet)
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["choices"][0]["message"]["content"], body
    assert body["choices"][0]["finish_reason"] == "stop", body
    wait_until(lambda: fleet.at_baseline() is True, 30, "pools at baseline")
    w = fleet.worker_info_fresh()
    assert w["prefill"]["transfers_acked"] >= 1 and w["decode"]["kv_bytes_received"] > 0


def test_cut_kv_link_fails_cleanly_and_recovers(fleet: Fleet) -> None:
    h = fleet.hosts
    kv_prefill_dev = h.kv_devs[0]
    before = fleet.worker_info_fresh()
    long_prompt = " ".join(f"Item {i} costs {i * 7 % 100} coins." for i in range(90))  # ~880 tokens
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            result["r"] = httpx.post(h.router_url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": long_prompt, "max_tokens": 8, "temperature": 0})
        except httpx.HTTPError as exc:
            result["exc"] = exc

    client = threading.Thread(target=ask)
    cut_at = None
    try:
        client.start()
        wait_until(lambda: fleet.info()["live_requests"] >= 1 or result, 30, "the request reached the router")
        assert not result, f"the long request ended before the cut: {result}"
        h.in_ns("prefill", "ip", "link", "set", kv_prefill_dev, "down")  # prefill is still computing the KV
        cut_at = time.monotonic()
        assert not h.reaches("prefill", "10.231.3.2")
        client.join(120)
        assert not client.is_alive(), "no answer 120 s after the KV link was cut"
        assert "exc" not in result, result
        r: httpx.Response = result["r"]
        assert r.status_code in (502, 504), f"{r.status_code}: {r.text[:500]}"
        err = r.json()["error"]
        assert isinstance(err["message"], str) and isinstance(err["type"], str), err
        assert err["code"] in ("transfer_timeout", "worker_failed"), err
        cut_status, cut_code = r.status_code, err["code"]
        # the pools come back while the link is still down: prefill frees at its transfer timeout, decode when
        # the router releases the reservation (or at its own reservation timeout)
        wait_until(lambda: fleet.at_baseline() is True, 30, "pools back to baseline with the link down")
        after = fleet.worker_info_fresh()
        assert after["prefill"]["kv_bytes_sent"] > before["prefill"]["kv_bytes_sent"]  # the KV was sent ...
        assert after["decode"]["transfers_acked"] == before["decode"]["transfers_acked"]  # ... never admitted
        assert after["prefill"]["transfers_acked"] == before["prefill"]["transfers_acked"]
        ended = fleet.info()["ended"]
        assert ended["failed"] >= 1, ended
    finally:
        h.in_ns("prefill", "ip", "link", "set", kv_prefill_dev, "up")
        client.join(120)
    down_for = time.monotonic() - (cut_at or time.monotonic())

    # Link back: new requests succeed again. TCP resumes at its next retransmission (the stale KV message of
    # the failed request, still queued on the same connection, goes first and is refused by decode), so the
    # first tries may still time out; each such failure must be a clean 502/504 and the recovery bounded.
    wait_until(lambda: h.reaches("prefill", "10.231.3.2"), 30, "the KV link carries packets again")
    outcomes: list[int] = []
    deadline = time.monotonic() + 90
    while True:
        r = greedy(fleet)
        outcomes.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code in (502, 504), f"{r.status_code}: {r.text[:500]}"
        assert "error" in r.json()
        assert time.monotonic() < deadline, f"no success within 90 s of restoring the link: {outcomes}"
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    print(f"\nnetns: cut KV link -> {cut_status} {cut_code}; link down {down_for:.1f}s; "
          f"after restoring it: {outcomes}")
    wait_until(lambda: fleet.at_baseline() is True, 30, "pools back to baseline at the end")
    print(json.dumps(fleet.info()["ended"]))


@pytest.mark.parametrize("fleet", ["nixl"], indirect=True)  # the read is decode's only with NIXL
def test_nixl_link_cut_while_decode_reads_fails_cleanly_and_releases_the_pinned_pages(fleet: Fleet) -> None:
    """NIXL only: the KV link is cut while decode's READ is in flight (the link slowed to 40 Mbit/s so the read
    of ~200 tokens takes a couple of seconds). At the read's deadline the request ends (the client gets a clean
    502/504 while the link is still down), but decode's pages stay pinned, reported as a read past its deadline,
    for as long as UCX cannot say the read is over: over TCP with the link down it says nothing (keepalive or
    not, measured: not within 90 s), and the pages are never freed on a timer. Once the link is back the read
    ends (UCX reports it over), and only then are they scrubbed and freed: nothing is admitted, both pools return
    to baseline."""
    w = fleet.workers()
    assert w["decode"]["kv_transport"] == "nixl"
    h = fleet.hosts
    dev = h.kv_devs[0]
    before = fleet.worker_info_fresh()
    prompt = " ".join(f"Item {i} costs {i * 7 % 100} coins." for i in range(20))
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            result["r"] = httpx.post(h.router_url + "/v1/completions", timeout=300, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        except httpx.HTTPError as exc:
            result["exc"] = exc

    h.in_ns("prefill", "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "40mbit", "burst", "32kbit",
            "latency", "400ms")
    client = threading.Thread(target=ask)
    try:
        client.start()
        wait_until(lambda: fleet.workers()["decode"].get("kv_landing", 0) >= 1 or result, 120,
                   "decode's NIXL read in flight")
        assert not result, f"the request ended before its read was in flight: {result}"
        h.in_ns("prefill", "ip", "link", "set", dev, "down")
        overdue_seen = 0
        deadline = time.monotonic() + 120
        while client.is_alive() and time.monotonic() < deadline:
            overdue_seen = max(overdue_seen, fleet.workers()["decode"].get("kv_reads_overdue", 0))
            time.sleep(0.3)
        client.join(1)
        assert not client.is_alive() and "exc" not in result, result
        r: httpx.Response = result["r"]
        assert r.status_code in (502, 504), f"{r.status_code}: {r.text[:500]}"
        err = r.json()["error"]
        assert err["code"] in ("transfer_timeout", "worker_failed"), err
        held = fleet.worker_info_fresh()["decode"]  # the link still down: the read is not over, its pages held
        assert held["kv_quarantined"] >= 1 and held["kv_reads_overdue"] >= 1, held
        overdue_seen = max(overdue_seen, held["kv_reads_overdue"])  # the polls above may all predate the deadline
        assert held["free_pages"] < held["pool_pages"], held
        assert fleet.at_baseline() is not True
        h.in_ns("prefill", "ip", "link", "set", dev, "up")
        h.in_ns("prefill", "tc", "qdisc", "del", "dev", dev, "root", check=False)

        def watch() -> bool:
            nonlocal overdue_seen
            overdue_seen = max(overdue_seen, fleet.workers()["decode"].get("kv_reads_overdue", 0))
            return fleet.at_baseline() is True

        wait_until(watch, 90, "pools back to baseline once the link is back (the read is over)")
        after = fleet.worker_info_fresh()
        assert after["decode"]["transfers_acked"] == before["decode"]["transfers_acked"]  # nothing admitted
        assert after["decode"]["kv_landing"] == 0 and after["decode"]["kv_quarantined"] == 0
        assert after["decode"]["kv_reads_in_flight"] == 0 and after["decode"]["kv_reads_overdue"] == 0
        assert overdue_seen >= 1, "the read outlived its deadline, but /info never reported it"
    finally:
        h.in_ns("prefill", "ip", "link", "set", dev, "up")
        h.in_ns("prefill", "tc", "qdisc", "del", "dev", dev, "root", check=False)
        client.join(120)
    wait_until(lambda: h.reaches("prefill", "10.231.3.2"), 30, "the KV link carries packets again")
    deadline = time.monotonic() + 90
    while (r := greedy(fleet)).status_code != 200:
        assert r.status_code in (502, 504) and time.monotonic() < deadline, f"{r.status_code}: {r.text[:300]}"
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    wait_until(lambda: fleet.at_baseline() is True, 30, "pools back to baseline at the end")
