"""kvseal's Tokenizer against transformers' tokenizer built from the same bundled GGUF."""

from __future__ import annotations

from typing import Any

import pytest

from kvseal.model.detokenize import IncrementalDecoder
from kvseal.model.tokenizer import Tokenizer
from tests.helpers.bundled import bundled_tokenizer, transformers_gguf_tokenizer

TEXTS = [
    "Hello world",
    " leading space and trailing space ",
    "x  1",  # spaces before a digit: transformers' GGUF pre-tokenizer keeps the GPT-2 regex here
    "a   123 4567 89.5e-3",
    "3.14159 1,000,000 $42.00 -7",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "naïve café résumé Ünïcödé",
    "日本語のテキスト 中文 한국어",
    "Здравствуй, мир! Ελληνικά",
    "emoji 🤖👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷",
    "\t\ttabs\n\n\nnewlines   \r\n  ",
    "     ",
    "",
    "I'm sure you'll see they've gone, it's fine, we'd've",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>kvseal<file_sep>",
    "not special: <|im_start and |im_end|> <im_start>",
    "ÿ\u0100\x00\x7f\u200b zero-width",
    "https://example.com/path?q=1&r=two#frag",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    return transformers_gguf_tokenizer()


def test_special_ids_and_vocab(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == 49152 == len(hf_tok)
    assert tok.bos_id == hf_tok.bos_token_id == 1
    assert tok.eos_ids == (hf_tok.eos_token_id,) == (2,)
    assert tok.add_bos is False
    assert tok.chat_template and tok.chat_template == hf_tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_add_bos_prepends_only_when_asked(tok: Tokenizer) -> None:
    with_bos = Tokenizer(tok.backend, bos_id=1, eos_ids=(2,), add_bos=True, chat_template=None)
    assert with_bos.encode("hi") == [1, *tok.encode("hi")]
    assert with_bos.encode("hi", add_special_tokens=False) == tok.encode("hi")
    with pytest.raises(ValueError, match="add_bos"):
        Tokenizer(tok.backend, bos_id=None, eos_ids=(2,), add_bos=True, chat_template=None)
    with pytest.raises(ValueError, match="eos_ids"):
        Tokenizer(tok.backend, bos_id=1, eos_ids=(10**6,), add_bos=False, chat_template=None)


class _CountingTokenizer:
    """Records how many ids each decode call sees, to prove the decoder works on a small window."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_decoder_concatenates_to_decode(tok: Tokenizer, skip_special_tokens: bool) -> None:
    text = "<|im_start|>assistant\n" + " ".join(TEXTS) * 4 + "<|im_end|>"
    ids = tok.encode(text)
    # The sequence really splits characters across tokens (else this test proves nothing).
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)
    counting = _CountingTokenizer(tok)
    dec = IncrementalDecoder(counting, skip_special_tokens=skip_special_tokens)
    pieces = [dec.feed(i) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in p for p in pieces)
    assert len(ids) > 400 and max(counting.window_sizes) <= 8  # O(1) work per token


def test_incremental_decoder_holds_split_emoji(tok: Tokenizer) -> None:
    ids = tok.encode("🤖")
    assert len(ids) > 1
    dec = tok.incremental_decoder()
    out = [dec.feed(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🤖"
    assert dec.flush() == ""
    # An unfinished character is only released, as U+FFFD, by flush().
    assert dec.feed(ids[0]) == "" and dec.flush() == "\ufffd"


def _hf_chat(hf_tok: Any, messages: list[dict[str, Any]]) -> str:
    return str(hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Hello! 🤖 <b>&</b>"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello, how can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
    ],
)
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok: Any, messages: list[dict[str, Any]]) -> None:
    assert tok.apply_chat_template(messages) == _hf_chat(hf_tok, messages)
    no_prompt = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == no_prompt


def test_chat_template_joins_text_parts(tok: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template([{"role": "user", "content": "one\ntwo"}])


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], "role"),
        ([{"role": "", "content": "hi"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": None}], "content"),
        ([{"role": "user", "content": 42}], "must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], r"content\[0\]"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"content\[0\]"),
    ],
)
def test_malformed_messages_raise(tok: Tokenizer, messages: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        tok.apply_chat_template(messages)


def test_template_environment(tok: Tokenizer) -> None:
    def with_template(template: str | None) -> Tokenizer:
        return Tokenizer(tok.backend, bos_id=1, eos_ids=(2,), add_bos=False, chat_template=template)

    msgs = [{"role": "user", "content": "<é & ü>"}]
    rendered = with_template("{{ bos_token }}{{ messages | tojson }}{{ eos_token }}").apply_chat_template(msgs)
    assert rendered == '<|im_start|>[{"role": "user", "content": "<é & ü>"}]<|im_end|>'
    assert with_template("{{ strftime_now('%Y') | length }}").apply_chat_template(msgs) == "4"
    with pytest.raises(ValueError, match="only user turns"):
        with_template("{{ raise_exception('only user turns') }}").apply_chat_template(msgs)
    with pytest.raises(ValueError, match="no chat_template"):
        with_template(None).apply_chat_template(msgs)
    with pytest.raises(ValueError, match="does not parse"):
        with_template("{% for %}").apply_chat_template(msgs)
