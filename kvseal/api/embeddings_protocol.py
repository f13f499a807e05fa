"""OpenAI's /v1/embeddings request body, validated (unknown fields are a 400 naming them).

`input` is a string, a list of strings, a list of token ids (one input) or a list of token id lists; OpenAI's
bound of 2048 inputs a request holds. Token ids are embedded as given, as vLLM does: the checkpoint's special
tokens ([CLS] ... [SEP] for BERT) are the caller's to include; text gets them from the tokenizer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from kvseal.api.protocol import _I32, Strict

MAX_INPUTS = 2048  # OpenAI's
SHAPE = "give a string, a list of strings, a list of token ids or a list of token id lists"


class EmbeddingRequest(Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]  # bounded by _shape, before the types are checked
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=_I32)] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, v: Any) -> Any:
        """One message for a shape that is none of the four (else pydantic names a branch: `input.str`)."""
        # ValueError, not TypeError: pydantic turns only a ValueError into the 400 that names the field
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("give at least one input" if v == [] else SHAPE)
        kinds = {type(x) for x in v}
        if len(kinds) != 1 or kinds - {str, int, list}:
            raise ValueError(SHAPE)
        if kinds == {list} and not all(x and all(type(t) is int for t in x) for x in v):
            raise ValueError("each token id list holds one or more token ids (integers)")
        if kinds != {int} and len(v) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} inputs a request, as OpenAI's API; send {len(v)} in several")
        ids = v if kinds == {int} else [t for x in v for t in x] if kinds == {list} else []
        if any(not 0 <= t <= _I32 for t in ids):
            raise ValueError("a token id is negative or past 2**31 - 1")
        return v

    def texts(self) -> list[str] | None:
        """The inputs as text, or None when they are token ids."""
        if isinstance(self.input, str):
            return [self.input]
        return [x for x in self.input if isinstance(x, str)] if isinstance(self.input[0], str) else None

    def token_ids(self) -> list[list[int]]:
        """The inputs as token id lists (only when texts() is None)."""
        ids = [x for x in self.input if isinstance(x, int)]
        return [ids] if ids else [x for x in self.input if isinstance(x, list)]
