"""Unit-test fixtures: a tiny random Llama checkpoint and a fake tokenizer (fakes live only in unit tests)."""

from __future__ import annotations

import pytest
import torch

from kvseal.config import CacheConfig, EngineConfig, SchedulerConfig
from kvseal.engine.engine import Engine
from kvseal.model.arch import ModelArch
from kvseal.model.checkpoint import Checkpoint


class _FakeEncoding:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _FakeBackend:
    """The parts of a `tokenizers.Tokenizer` kvseal calls beside the Tokenizer: the digest and batch encoding."""

    def to_str(self) -> str:  # what identity.tokenizer_digest hashes
        return "fake: one character per token id"

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[_FakeEncoding]:
        return [_FakeEncoding([ord(c) - ord("a") + 2 for c in t]) for t in texts]


class FakeTokenizer:
    """One character per token id: 'a' + id % 26. Id 1 is EOS."""

    bos_id = None
    eos_ids = (1,)
    vocab_size = 64
    add_bos = False
    chat_template = bos_token = eos_token = None
    backend = _FakeBackend()
    longest_token_bytes = 4  # one character a token: at most 4 bytes of UTF-8

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids if not (skip_special_tokens and i in self.eos_ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) - ord("a") + 2 for c in text]


def tiny_checkpoint(seed: int = 0) -> Checkpoint:
    arch = ModelArch(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_eps=1e-5,
                     max_position=512, tie_embeddings=True, attention_bias=False)
    g = torch.Generator().manual_seed(seed)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(64, 32, generator=g),
                                  "model.norm.weight": torch.ones(32)}
    shapes = {"self_attn.q_proj": (32, 32), "self_attn.k_proj": (16, 32), "self_attn.v_proj": (16, 32),
              "self_attn.o_proj": (32, 32), "mlp.gate_proj": (64, 32), "mlp.up_proj": (64, 32),
              "mlp.down_proj": (32, 64)}
    for i in range(2):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.2
        w[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(32)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(32)
    return Checkpoint(arch, w, FakeTokenizer(), "tiny", "memory")  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def tiny() -> Checkpoint:
    return tiny_checkpoint()


def make_engine(ck: Checkpoint, pool_tokens: int = 1024, page_size: int = 4, budget: int = 64,
                scrub: bool = True, wait_timeout: float = 60.0, max_model_len: int | None = None,
                prefix_cache: bool = True, speculative: str = "lookup") -> Engine:
    from kvseal.config import ModelConfig

    return Engine(EngineConfig(model=ModelConfig(max_model_len=max_model_len),
                               cache=CacheConfig(page_size=page_size, pool_tokens=pool_tokens, scrub=scrub,
                                                 prefix_cache=prefix_cache),
                               scheduler=SchedulerConfig(max_num_batched_tokens=max(budget, 16),
                                                         wait_timeout_s=wait_timeout,
                                                         speculative=speculative)), ck)
