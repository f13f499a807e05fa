"""OpenAI's /v1/embeddings request body, validated (unknown fields are a 400 naming them).

`input` is a string, a list of strings, a list of token ids (one input) or a list of token id lists; OpenAI's
bound of 2048 inputs a request holds. Token ids are embedded as given, as vLLM does: the checkpoint's special
tokens ([CLS] ... [SEP] for BERT) are the caller's to include; text gets them from the tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvseal.router.protocol import _I32, Strict

MAX_INPUTS = 2048  # OpenAI's
TokenId = Annotated[int, Field(ge=0, le=_I32)]


class EmbeddingRequest(Strict):
    model: str
    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_INPUTS)]
            | Annotated[list[TokenId], Field(min_length=1)]
            | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1,
                                                                                 max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=_I32)] | None = None
    user: str | None = None

    def texts(self) -> list[str] | None:
        """The inputs as text, or None when they are token ids."""
        if isinstance(self.input, str):
            return [self.input]
        return [x for x in self.input if isinstance(x, str)] if isinstance(self.input[0], str) else None

    def token_ids(self) -> list[list[int]]:
        """The inputs as token id lists (only when texts() is None)."""
        first = self.input[0]
        return [list(self.input)] if isinstance(first, int) else [list(x) for x in self.input]  # type: ignore[arg-type]
