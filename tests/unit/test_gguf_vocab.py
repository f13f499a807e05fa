"""The byte-level BPE tokenizer's vocabulary and merges from a GGUF (model/gguf_tokenizer.py), built at C speed, equal
to their definitions: each token re-spelled into the byte alphabet when it has a character outside it (a later id
wins a clash), each merge split on its one space, and the first malformed merge named in the error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvseal.model.gguf_file import GGUFFile
from kvseal.model.gguf_tokenizer import _byte_level_vocab, _merge_pairs, bytes_to_unicode
from kvseal.model.locate import default_model_path

SPELLING = bytes_to_unicode()
OUTSIDE = re.compile("[^" + "".join(re.escape(c) for c in sorted(set(SPELLING.values()))) + "]")


def vocab_by_definition(tokens: list[str]) -> dict[str, int]:
    def respell(t: str) -> str:
        return "".join(SPELLING[b] for b in t.encode("utf-8"))

    return {respell(t) if OUTSIDE.search(t) else t: i for i, t in enumerate(tokens)}


def merges_by_definition(merges: list[str]) -> list[tuple[str, str]]:
    split = [m.split(" ") for m in merges]
    bad = next((m for m, pair in zip(merges, split, strict=True) if len(pair) != 2), None)
    if bad is not None:
        raise ValueError(bad)
    return [(a, b) for a, b in split]


def test_respelled_tokens_clashes_and_empty_tokens_as_defined() -> None:
    # " a" re-spells to "Ġa", which is also token 1: the later id (3) wins, in the first one's place
    tokens = ["a", "Ġa", "", " a", "héllo", "Ċ", "x y", "日本", "", "b", "\n"]
    got = _byte_level_vocab(tokens, SPELLING, OUTSIDE)
    want = vocab_by_definition(tokens)
    assert got == want and list(got) == list(want)
    assert got["Ġa"] == 3 and got["héllo"] == 4  # é is in the byte alphabet (Latin-1's printable half)
    assert "日本" not in got and got["æĹ¥æľ¬"] == 7 and got["Ċ"] == 10


def test_a_vocabulary_wholly_inside_the_alphabet_is_kept_as_it_is() -> None:
    tokens = ["Ġthe", "Ċ", "abc", "Ġ", "ĠĠ"]
    assert _byte_level_vocab(tokens, SPELLING, OUTSIDE) == {t: i for i, t in enumerate(tokens)}


def test_merges_split_on_their_one_space() -> None:
    merges = ["Ġ t", "h e", "Ġt he", "a\nb c"]  # a newline inside a merge: split as before, on the space
    assert _merge_pairs(merges) == merges_by_definition(merges)
    assert _merge_pairs(merges[:3]) == [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]


@pytest.mark.parametrize("bad", ["ab", "a b c", "", "a  b"])
def test_a_malformed_merge_is_named(bad: str) -> None:
    merges = ["a b", bad, "c d", "e  f"]
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        _merge_pairs(merges)


def test_two_wrongs_that_balance_the_space_count_are_still_refused() -> None:
    """"ab" (no space) and "a b c" (two): as many spaces as merges, yet both malformed."""
    with pytest.raises(ValueError, match=re.escape(repr("ab"))):
        _merge_pairs(["x y", "ab", "a b c"])


def real_ggufs() -> list[Path]:
    models = Path.home() / ".cache" / "kvseal" / "models"
    found = [Path(default_model_path())]
    found += [p for p in sorted(models.glob("*.gguf")) if "qwen" in p.name]  # the byte-level BPE files setup fetched
    return found


@pytest.mark.parametrize("path", real_ggufs(), ids=lambda p: p.name)
def test_a_real_files_vocabulary_and_merges_equal_their_definitions(path: Path) -> None:
    r = GGUFFile(str(path))
    tokens, merges = r.field("tokenizer.ggml.tokens"), r.field("tokenizer.ggml.merges")
    assert _byte_level_vocab(tokens, SPELLING, OUTSIDE) == vocab_by_definition(tokens)
    assert _merge_pairs(merges) == merges_by_definition(merges)
