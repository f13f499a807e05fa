"""The two halves of a disaggregated engine, for tests that drive a handoff by hand: an Engine with its role's KV
connector attached (engine/kv_prefill.py, engine/kv_decode.py). A worker attaches its own; give it a bare
`Engine(cfg, ckpt, role=...)`."""

from __future__ import annotations

from kvseal.config import EngineConfig
from kvseal.engine.engine import Engine
from kvseal.engine.kv_decode import DecodeConnector
from kvseal.engine.kv_prefill import PrefillConnector
from kvseal.model.checkpoint import Checkpoint


class PrefillHalf(Engine):
    kv: PrefillConnector


class DecodeHalf(Engine):
    kv: DecodeConnector


def prefill_engine(cfg: EngineConfig, ckpt: Checkpoint) -> PrefillHalf:
    e = Engine(cfg, ckpt, role="prefill")
    PrefillConnector(e)
    return e  # type: ignore[return-value]  # an Engine whose kv is a PrefillConnector


def decode_engine(cfg: EngineConfig, ckpt: Checkpoint) -> DecodeHalf:
    e = Engine(cfg, ckpt, role="decode")
    DecodeConnector(e)
    return e  # type: ignore[return-value]
