"""A SentencePiece GGUF's merges (rebuilt from its vocabulary: seconds for Gemma 3's 262,144 tokens) are kept in the
weights cache under a digest of their input: the second start reads them, a damaged or foreign file is rebuilt, and
another vocabulary never gets this one's merges."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvseal.model import spm_tokenizer
from kvseal.model.spm_tokenizer import SPACE, cached_merges, rebuild_merges


def _vocab() -> tuple[dict[str, int], dict[str, float]]:
    # pieces with spaces, newlines, a NUL and a private-use character: none may confuse the file's framing
    tokens = ["a", "b", "ab", "abb", "\n", "\n\n", SPACE, SPACE + "a", "x\x00", "x", "\x00", "\ue000", "x\ue000",
              "ba", "bab"]
    return {t: i for i, t in enumerate(tokens)}, {t: -float(i) for i, t in enumerate(tokens)}


def test_the_second_build_reads_the_merges_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSEAL_WEIGHTS_CACHE_DIR", str(tmp_path))
    vocab, scores = _vocab()
    want = rebuild_merges(vocab, scores)
    assert ("x", "\x00") in want and ("x", "\ue000") in want and ("\n", "\n") in want
    assert cached_merges(vocab, scores) == want
    files = list((tmp_path / "tokenizer").glob("merges-*.txt"))
    assert len(files) == 1

    def refuse(*_: object) -> list[tuple[str, str]]:
        raise AssertionError("rebuilt although the cache holds them")

    monkeypatch.setattr(spm_tokenizer, "rebuild_merges", refuse)
    assert cached_merges(vocab, scores) == want  # read from the file, pair for pair and in order


@pytest.mark.parametrize("damage", ["truncate", "other_digest", "odd_parts", "empty"])
def test_a_damaged_cache_file_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    monkeypatch.setenv("KVSEAL_WEIGHTS_CACHE_DIR", str(tmp_path))
    vocab, scores = _vocab()
    want = cached_merges(vocab, scores)
    (path,) = (tmp_path / "tokenizer").glob("merges-*.txt")
    text = path.read_text(encoding="utf-8")
    head, rest = text.split("\n", 1)
    sep = rest[0]
    path.write_text({"truncate": text[: len(head) + 6],
                     "other_digest": "0" * 64 + head[64:] + "\n" + rest,
                     "odd_parts": text + sep + "extra",
                     "empty": ""}[damage], encoding="utf-8")
    assert cached_merges(vocab, scores) == want
    assert path.read_text(encoding="utf-8") == text  # written again, whole


def test_another_vocabulary_gets_its_own_merges(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSEAL_WEIGHTS_CACHE_DIR", str(tmp_path))
    vocab, scores = _vocab()
    first = cached_merges(vocab, scores)
    # the same tokens with two scores swapped: another merge order, another file
    swapped = dict(scores)
    swapped["ab"], swapped["ba"] = scores["ba"], scores["ab"]
    assert cached_merges(vocab, swapped) == rebuild_merges(vocab, swapped) != first
    assert len(list((tmp_path / "tokenizer").glob("merges-*.txt"))) == 2
