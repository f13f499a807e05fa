"""The lower bound on a text's token count from its UTF-8 length (model/token_bound.py) never exceeds the count the
tokenizer gives, on real vocabularies and on texts built to be as few tokens as possible; a tokenizer that may
shrink or drop text before its vocabulary gets no bound at all."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from kvseal.model.locate import load_tokenizer
from kvseal.model.token_bound import longest_token_bytes, min_tokens
from tests.helpers.bundled import bundled_tokenizer
from tests.helpers.real_models import real_model
from tests.helpers.tiny_models import build_tiny_tokenizer

from .test_tokenizer import TEXTS


def backends() -> list[tuple[str, Tokenizer]]:
    return [("bundled", bundled_tokenizer().backend),
            ("qwen2.5-coder-0.5b", load_tokenizer(real_model("qwen2.5-coder-0.5b"))[0].backend),
            ("tiny-llama", build_tiny_tokenizer("llama")), ("tiny-qwen2-nfc", build_tiny_tokenizer("qwen2"))]


def hard_texts(backend: Tokenizer, rng: random.Random) -> list[str]:
    """Texts of few tokens for their length: the longest tokens repeated, runs of what long tokens hold, jamo that
    NFC composes three into one, and random Unicode."""
    vocab = backend.get_vocab(with_added_tokens=True)
    longest = sorted(vocab, key=lambda t: -len(backend.decode([vocab[t]], skip_special_tokens=False)))[:20]
    spelled = [backend.decode([vocab[t]], skip_special_tokens=False) for t in longest]
    out = [s * 50 for s in spelled] + ["".join(rng.choice(spelled) for _ in range(200))]
    out += [" " * 5000, "-" * 5000, "/" + "*" * 3000, "\n" * 2000, "<|im_start|>" * 300, "\u1100\u1161\u11a8" * 500]
    out += ["".join(chr(rng.randrange(0x20, 0x2FFFF)) for _ in range(300)).encode("utf-8", "ignore").decode()
            for _ in range(5)]
    return out + TEXTS


@pytest.mark.parametrize(("name", "backend"), backends(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_bound_never_exceeds_the_real_count(name: str, backend: Tokenizer) -> None:
    longest = longest_token_bytes(backend)
    assert longest is not None, f"{name}: a tokenizer kvseal serves gets a bound"
    tight = 0
    for text in hard_texts(backend, random.Random(0)):
        n = len(backend.encode(text, add_special_tokens=False).ids)
        bound = min_tokens(len(text.encode("utf-8")), longest)
        assert bound <= n, (name, text[:40], bound, n)
        tight = max(tight, bound / max(n, 1))
    assert tight > 0.3, f"{name}: the bound is never close to the count ({tight:.2f}): it refuses nothing"


def test_a_tokenizer_that_may_shrink_or_drop_text_gets_no_bound() -> None:
    def bpe(**parts: object) -> Tokenizer:
        tok = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>"))
        for k, v in parts.items():
            setattr(tok, k, v)
        return tok

    assert longest_token_bytes(bpe()) == 5
    assert longest_token_bytes(bpe(normalizer=normalizers.NFC())) == 15
    for shrinking in (normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip(),
                      normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()]),
                      normalizers.Replace("  ", " ")):
        assert longest_token_bytes(bpe(normalizer=shrinking)) is None, shrinking
    assert longest_token_bytes(bpe(pre_tokenizer=pre_tokenizers.Whitespace())) is None  # drops spaces
    assert longest_token_bytes(bpe(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed"))) is None
    fused = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert longest_token_bytes(fused) is None  # any run of unknown text is one token
    assert longest_token_bytes(Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))) is None
