"""The two halves of a disaggregated engine, for tests that drive a handoff by hand: an Engine whose role's KV
connector (engine/kv_prefill.py, engine/kv_decode.py) it built itself, typed as such. A worker takes a bare
`Engine(cfg, ckpt, role=...)` and asks it for the same connector."""

from __future__ import annotations

from kvseal.config import EngineConfig
from kvseal.engine.engine import Engine
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire.roles import Role


class PrefillHalf(Engine):
    kv: PrefillConnector


class DecodeHalf(Engine):
    kv: DecodeConnector


def prefill_engine(cfg: EngineConfig, ckpt: Checkpoint) -> PrefillHalf:
    return Engine(cfg, ckpt, role=Role.PREFILL)  # type: ignore[return-value]  # an Engine whose kv is a PrefillConnector


def decode_engine(cfg: EngineConfig, ckpt: Checkpoint) -> DecodeHalf:
    return Engine(cfg, ckpt, role=Role.DECODE)  # type: ignore[return-value]
