"""Fleet keys on the KV channel, over real sockets on 127.0.0.1 (both ends in this process).

Encrypted (`--kv-channel curve`, and NIXL's offers): members move KV over CURVE; a stranger (no key, or a key off
the allow-list) gets no frame read; a sender pins the receiver's key, so a rogue bound where it connects gets
nothing; deleting a public key revokes that member. MAC framing (the default for ZeroMQ's KV bytes): a stranger
without the session token is refused at the handshake; a message whose tag does not check out (tampered, or
untagged) is dropped unread and unanswered; an acknowledgement without the tag is not believed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvseal.auth.curve import as_client, as_plain_server, as_server
from kvseal.auth.keys import MemberKeys, fresh_member, load_member, public_key, write_key_set
from kvseal.auth.zap import USER, ZapHandler
from kvseal.transfer.base import TransferHandle, TransferState, TransferStatus
from kvseal.transfer.kvmac import KvMac, new_session
from kvseal.transfer.manifest import (
    build_manifest,
    pack_pages,
)
from kvseal.transfer.zmq import ZmqTransport
from kvseal.transfer.zmq_wire import TransferHeader, TransferReply
from kvseal.wire.kvspec import KVSpec
from kvseal.wire.reservation import Reservation, new_nonce, new_reservation_id
from kvseal.worker.join import Registration

pytestmark = [pytest.mark.integration, pytest.mark.serial]  # serial: 1.5 s transfer timeouts (scripts/test.sh)
L, P, S, KVH, D = 2, 8, 4, 2, 8


@pytest.fixture
def keyset(tmp_path: Path) -> Path:
    write_key_set(str(tmp_path / "keys"), ["prefill", "decode"])
    return tmp_path / "keys"


@pytest.fixture
def decode(keyset: Path) -> Iterator[ZmqTransport]:
    rx = ZmqTransport(keys=load_member(str(keyset), "decode"), encrypt=True)
    rx.listen("tcp://127.0.0.1:0")
    yield rx
    rx.close()


@pytest.fixture
def decode_mac(keyset: Path) -> Iterator[ZmqTransport]:
    rx = ZmqTransport(keys=load_member(str(keyset), "decode"))
    rx.listen("tcp://127.0.0.1:0")
    assert rx.kv_session  # what its reservations carry
    yield rx
    rx.close()


def _send(tx: ZmqTransport, endpoint: str, server_key: str | None, timeout_s: float = 30.0,
          session: str | None = None) -> tuple[TransferHandle, Reservation]:
    k = torch.randn(L, P, S, KVH, D).to(torch.bfloat16)
    v = torch.randn(L, P, S, KVH, D).to(torch.bfloat16)
    res = Reservation(request_id="r1", reservation_id=new_reservation_id(), nonce=new_nonce(), num_tokens=2 * S,
                      page_ids=[0, 1], kv_endpoint=endpoint, kv_key=server_key or "",
                      kv=KVSpec(model_fingerprint="fp", page_size=S, kv_dtype="bfloat16", kv_layout="x"))
    payload = pack_pages(k, v, [3, 5])
    man = build_manifest(res, payload, num_tokens=2 * S, first_token=0, kv=res.kv)
    return tx.send(res.kv_endpoint, man, payload, timeout_s=timeout_s, server_key=server_key, session=session), res


def _settle(tx: ZmqTransport, h: TransferHandle, rx: ZmqTransport | None, seconds: float) -> TransferStatus:
    """Answer whatever reaches rx (ack) and poll tx until its transfer ends or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        if rx is not None and (a := rx.recv(0.05)) is not None:
            a.reply(True)
        st = tx.poll(h)
        if st.done or time.monotonic() > deadline:
            return st


def _never_delivered(st: TransferStatus) -> bool:
    """A transfer whose handshake fails ends unacknowledged: TIMED_OUT when the message was queued before the
    refusal dropped the pipe, FAILED at once (naming the handshake) when the refusal came first. Which one is a
    race between this thread and ZeroMQ's I/O thread; neither is ever ACKED."""
    if st.state is TransferState.TIMED_OUT:
        return True
    return (st.state is TransferState.FAILED and st.error is not None
            and "failed the handshake" in st.error.message)


def _auth_failed(sock: zmq.Socket[bytes], monitor: zmq.Socket[bytes], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return True
    return False


def test_members_move_kv_over_curve_and_strangers_get_nothing_read(keyset: Path, decode: ZmqTransport) -> None:
    ctx = zmq.Context()
    try:
        # a stranger without keys (what every rogue of issue 17 was): the CURVE server never reads its frame
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(str(decode._endpoint))
        plain.send_multipart([b"\x81\xabtransfer_id\xa1x", b"K", b"V"])
        # a stranger with a key of its own, pinning decode's real key: refused by the allow-list at the handshake
        stranger = ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        monitor = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        as_client(stranger, fresh_member(), public_key(str(keyset), "decode"), "test")
        stranger.connect(str(decode._endpoint))
        stranger.send_multipart([b"\x81\xabtransfer_id\xa1y", b"K", b"V"])
        assert _auth_failed(stranger, monitor), "the stranger's handshake was not refused"
        assert decode.recv(1.0) is None  # nothing read, so nothing to answer
        assert plain.poll(200) == 0 and stranger.poll(200) == 0  # and nothing answered
        assert decode.auth_refused == 1  # the keyed stranger, counted (the keyless one never reached ZAP)
        stranger.disable_monitor()
        monitor.close(0)
        for s in (plain, stranger):
            s.close(0)
    finally:
        ctx.destroy(linger=0)  # closes what a failed assertion left open
    # a member pinning decode's key: the transfer goes through (and decode still serves after the strangers)
    with ZmqTransport(keys=load_member(str(keyset), "prefill")) as tx:
        h, _ = _send(tx, str(decode._endpoint), public_key(str(keyset), "decode"))
        assert _settle(tx, h, decode, 30).state is TransferState.ACKED


def test_a_sender_pins_the_receivers_key(keyset: Path, decode: ZmqTransport) -> None:
    prefill = load_member(str(keyset), "prefill")
    with ZmqTransport(keys=prefill) as tx:
        # a key that is not on prefill's allow-list: refused before any connection
        h, _ = _send(tx, str(decode._endpoint), fresh_member().public)
        st = tx.poll(h)
        assert st.state is TransferState.FAILED and st.error is not None and "allow-list" in st.error.message
        # an allowed key that decode does not hold (prefill's own): the handshake fails, nothing arrives
        h, _ = _send(tx, str(decode._endpoint), prefill.public, timeout_s=1.5)
        assert _never_delivered(_settle(tx, h, decode, 5))
        assert decode.recv(0.2) is None


@pytest.mark.parametrize("rogue_keys", ["none", "own"])
def test_a_rogue_bound_where_prefill_connects_gets_no_frame(keyset: Path, rogue_keys: str) -> None:
    """The rogue binds the endpoint a reservation names; prefill pins decode's key, so no handshake completes."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    if rogue_keys == "own":
        as_server(rogue, fresh_member())  # CURVE with its own keypair, and no ZAP handler: it would take anyone
        rogue.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZmqTransport(keys=load_member(str(keyset), "prefill")) as tx:
            h, _ = _send(tx, f"tcp://127.0.0.1:{port}", public_key(str(keyset), "decode"), timeout_s=1.5)
            assert _never_delivered(_settle(tx, h, None, 5))
            h, _ = _send(tx, f"tcp://127.0.0.1:{port}", public_key(str(keyset), "decode"), timeout_s=1.5)
            assert _never_delivered(_settle(tx, h, None, 5))  # nor the next one, on the connection already tried
        assert rogue.poll(300) == 0  # not one frame reached the rogue
    finally:
        rogue.close(0)
        ctx.destroy(linger=0)  # closes what a failed assertion left open


def test_deleting_a_public_key_revokes_that_member(keyset: Path, decode: ZmqTransport) -> None:
    (keyset / "public" / "prefill.key").unlink()
    revoked: MemberKeys = load_member(str(keyset), "decode")  # any other member still loads
    assert revoked.admits(public_key(str(keyset), "decode"))
    prefill = MemberKeys(public=_prefill_public(keyset), secret=_prefill_secret(keyset),
                         allowed=(public_key(str(keyset), "decode"),))
    with ZmqTransport(keys=prefill) as tx:
        h, _ = _send(tx, str(decode._endpoint), public_key(str(keyset), "decode"), timeout_s=1.5)
        assert _never_delivered(_settle(tx, h, decode, 5))
    assert decode.auth_refused >= 1


def _prefill_public(keyset: Path) -> str:
    return zmq.auth.load_certificate(keyset / "private" / "prefill.key_secret")[0].decode()


def _prefill_secret(keyset: Path) -> str:
    secret = zmq.auth.load_certificate(keyset / "private" / "prefill.key_secret")[1]
    assert secret is not None
    return secret.decode()


def test_a_worker_whose_key_the_router_refuses_stops_with_the_reason(keyset: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The join of `kvseal decode --router`: refused at the handshake, it stops saying why (the worker then exits
    with EXIT_REFUSED: test_fleet_join, test_doctor and test_metrics see the status of real refused workers)."""
    router = fresh_member()  # a router whose allow-list holds none of this key set
    ctx = zmq.Context()
    zap = ZapHandler(ctx, router, "fleet port")
    fleet = ctx.socket(zmq.ROUTER)
    fleet.setsockopt(zmq.LINGER, 0)
    as_server(fleet, router)
    port = fleet.bind_to_random_port("tcp://127.0.0.1")
    reg = Registration(ctx, f"tcp://127.0.0.1:{port}", "decode", "tcp://127.0.0.1:1",
                       load_member(str(keyset), "prefill"), router.public)
    poller = zmq.Poller()
    try:
        reg.start(poller)
        stop, deadline = False, time.monotonic() + 5
        while not stop and time.monotonic() < deadline:
            for sock, _ in poller.poll(100):
                stop = stop or reg.on_readable(sock)
        assert stop
        assert "refused this worker's fleet key at the handshake" in caplog.text
        assert fleet.poll(100) == 0 and zap.refused == 1  # its JoinReq was never read
    finally:
        reg.close()
        fleet.close(0)
        zap.stop()
        ctx.term()


def _mac_stranger(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, token: bytes | None) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, USER)
        sock.setsockopt(zmq.PLAIN_PASSWORD, token)
    sock.connect(endpoint)
    return sock


def test_the_mac_channel_drops_what_it_cannot_authenticate(keyset: Path, decode_mac: ZmqTransport) -> None:
    rx, endpoint = decode_mac, str(decode_mac._endpoint)
    decode_key = public_key(str(keyset), "decode")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        # a wrong token: refused by ZAP at the handshake; no credentials at all: no handshake
        wrong = _mac_stranger(ctx, endpoint, b"0" * 64)
        monitor = wrong.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        wrong.send_multipart([b"x", b"K", b"V", b"t" * 32])
        assert _auth_failed(wrong, monitor)
        _mac_stranger(ctx, endpoint, None).send_multipart([b"x", b"K", b"V"])
        assert rx.recv(0.5) is None and rx.auth_refused == 1 and rx.frames_unauthenticated == 0
        # the right token (seen on the wire by someone on the path) but a message that was changed after its
        # tag, or carries none: dropped before a byte of it is read, and never answered
        mac = KvMac(rx.kv_session)
        tapper = _mac_stranger(ctx, endpoint, mac.token)
        header, k, v = b"\x81\xabtransfer_id\xa1z", bytes(64), bytes(64)
        tag = mac.tag([header, k, v])
        tapper.send_multipart([header, b"\x01" + k[1:], v, tag])
        tapper.send_multipart([header, k, v])
        deadline = time.monotonic() + 5
        while rx.frames_unauthenticated < 2 and time.monotonic() < deadline:
            assert rx.recv(0.1) is None
        assert rx.frames_unauthenticated == 2 and tapper.poll(300) == 0
    finally:
        ctx.destroy(linger=0)
    # a member with the reservation's session: the transfer goes through, both ways tagged
    with ZmqTransport(keys=load_member(str(keyset), "prefill")) as tx:
        h, _ = _send(tx, endpoint, decode_key, session=rx.kv_session)
        assert _settle(tx, h, rx, 30).state is TransferState.ACKED


def test_an_acknowledgement_without_the_tag_is_not_believed(keyset: Path) -> None:
    """A rogue at decode's endpoint sees the KV bytes (they cross in clear) but cannot fake decode's ack."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    session = new_session()
    zap = ZapHandler(ctx, fresh_member(), "rogue", KvMac(session).token)  # it saw the token on the wire
    rogue = ctx.socket(zmq.ROUTER)
    rogue.setsockopt(zmq.LINGER, 0)
    as_plain_server(rogue)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ZmqTransport(keys=load_member(str(keyset), "prefill")) as tx:
            h, _ = _send(tx, f"tcp://127.0.0.1:{port}", public_key(str(keyset), "decode"), timeout_s=2.0,
                         session=session)
            assert rogue.poll(5000)
            peer, header, *_ = rogue.recv_multipart()
            tid = msgspec.msgpack.decode(header, type=TransferHeader).transfer_id
            ack = msgspec.msgpack.encode(TransferReply(transfer_id=tid, ok=True))
            rogue.send_multipart([peer, ack])  # untagged
            rogue.send_multipart([peer, ack, KvMac(new_session()).tag([ack])])  # tagged with another session
            assert _settle(tx, h, None, 5).state is TransferState.TIMED_OUT
    finally:
        rogue.close(0)
        zap.stop()
        ctx.term()
