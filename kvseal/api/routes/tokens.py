"""/tokenize and /detokenize in vLLM's shape.

POST /tokenize {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"};
POST /detokenize {"tokens": [int]} -> {"prompt": str}. A text longer than the served window is a 400
(context_length_exceeded), as in vLLM. A chat is rendered with the served chat template, as
/v1/chat/completions renders it, so `count` is what a chat request's usage.prompt_tokens will say.
"""

from __future__ import annotations

from typing import Any, TypeVar

from fastapi import APIRouter, Body, Request
from pydantic import BaseModel, ValidationError

from kvseal.api.http_errors import validation_error
from kvseal.api.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    message_dicts,
)
from kvseal.api.routes.deps import backend_of, check_model, prompt_text
from kvseal.errors import ContextLengthExceeded, InvalidRequest

router = APIRouter()


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: Any) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


@router.post("/tokenize")
async def tokenize(request: Request, body: Any = Body(...)) -> dict[str, Any]:  # noqa: B008 (FastAPI's idiom)
    backend, texts = backend_of(request), prompt_text(request)
    req: TokenizeChatRequest | TokenizeCompletionRequest
    if isinstance(body, dict) and "messages" in body:
        req = parse(TokenizeChatRequest, body)
        try:
            text = await texts.render(message_dicts(req.messages), req.add_generation_prompt)
        except ValueError as exc:
            raise InvalidRequest(f"messages: {exc}", param="messages") from exc
    else:
        req = parse(TokenizeCompletionRequest, body)
        text = req.prompt
    check_model(backend, req.model)
    param = "messages" if isinstance(req, TokenizeChatRequest) else "prompt"
    ids = await texts.encode(text, param, req.add_special_tokens)
    if len(ids) > backend.context_window:  # as vLLM: a text the model cannot take is an error, not megabytes of ids
        raise ContextLengthExceeded(f"This model's maximum context length is {backend.context_window} tokens. "
                                    f"However, your {param} resulted in {len(ids)} tokens. Please reduce the length "
                                    f"of the {param}.", param=param)
    strs = [backend.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs \
        else None
    return {"count": len(ids), "max_model_len": backend.context_window, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    backend = backend_of(request)
    check_model(backend, body.model)
    if any(t >= backend.tokenizer.vocab_size for t in body.tokens):
        raise InvalidRequest("a token id is outside the vocabulary", param="tokens")
    return {"prompt": backend.tokenizer.decode(body.tokens, skip_special_tokens=False)}
