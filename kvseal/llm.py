"""The Python API, shaped like vLLM's offline one: `LLM(model=None, **engine_options).generate(prompts,
SamplingParams(...))` and `LLM.chat(messages, ...)`, in this process, on the same engine that serves HTTP.

    from kvseal import LLM, SamplingParams
    llm = LLM()                                   # the bundled SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text, out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason)

engine_options are the fields of kvseal.config's ModelConfig, CacheConfig, SchedulerConfig and GrammarConfig by
name (dtype, kernels, arithmetic, max_model_len, page_size, pool_tokens, kv_dtype, prefix_cache,
max_num_batched_tokens, grammar_timeout_s, ...) and `seed`. A request the engine refuses raises its error
(kvseal.errors.KvsealError), never a stand-in output.
With n > 1 the first sample computes the prompt and the others start once it is in the prefix cache, so the
samples share the prompt's pages; each sample has its own seed stream (wire/seeds.sample_seed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from kvseal.config_args import engine_config_from_options
from kvseal.engine.engine import Engine
from kvseal.errors import KvsealError
from kvseal.model.checkpoint import Checkpoint
from kvseal.wire import messages as M
from kvseal.wire.messages import response_format
from kvseal.wire.seeds import sample_seed

Prompt = str | list[int]


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's SamplingParams, the fields kvseal implements. response_format is OpenAI's object:
    {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": {...}}}."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # the sampled token's logprob and the top k per output token
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"invalid n={self.n}: give at least 1 sample")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"invalid max_tokens={self.max_tokens}: give at least 1, or None for the window")

    def engine_params(self, index: int, max_tokens: int, fmt: M.ResponseFormat | None) -> M.SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return M.SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=max(self.top_k, 0), seed=sample_seed(self.seed, index), stop=stop,
                                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                                logprobs=self.logprobs, min_tokens=self.min_tokens, response_format=fmt)

    def format(self) -> M.ResponseFormat | None:
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        schema = rf.get("json_schema", {}).get("schema") if rf.get("type") == "json_schema" else None
        return response_format(str(rf.get("type")), schema)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token: {token id: logprob}, the sampled one first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (over all samples)


class LLM:
    def __init__(self, model: str | None = None, *, checkpoint: Checkpoint | None = None,
                 **engine_options: Any) -> None:
        """model: a .gguf file or a Hugging Face folder (None: the bundled model); checkpoint: one already
        loaded (tests share it); engine_options: see the module doc."""
        self.engine = Engine(engine_config_from_options(model, engine_options), checkpoint)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """The API over an engine built elsewhere (tests and benches that also read its pools)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer, llm._ids = engine, engine.tokenizer, itertools.count()
        return llm

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None,
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt (text, or token ids), in order."""
        one = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
        batch = cast(list[Prompt], [prompts] if one else list(prompts))
        params = sampling_params or SamplingParams()
        outs = []
        for p in batch:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p]
            outs.append(RequestOutput(f"{next(self._ids)}", p if isinstance(p, str) else None, ids))
        self._run(outs, params)
        return outs

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Each conversation rendered with the model's chat template (or `chat_template`), then generated."""
        one = bool(messages) and isinstance(messages[0], dict)
        convs = cast(list[list[dict[str, Any]]], [messages] if one else messages)
        tok = self.tokenizer if chat_template is None else self.tokenizer.with_chat_template(chat_template,
                                                                                             "chat_template")
        texts = [tok.apply_chat_template(c, add_generation_prompt) for c in convs]
        outs = [RequestOutput(f"{next(self._ids)}", t, tok.encode(t, add_special_tokens=False)) for t in texts]
        self._run(outs, sampling_params or SamplingParams())
        return outs

    def _run(self, outs: list[RequestOutput], params: SamplingParams) -> None:
        fmt = params.format()
        engine, window = self.engine, self.engine.context_window
        samples: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        followers: dict[str, list[M.GenerateRequest]] = {}  # sample 0's id -> the samples that wait for it
        for out in outs:
            max_tokens = params.max_tokens or max(window - len(out.prompt_token_ids), 1)
            reqs = [M.GenerateRequest(f"{out.request_id}-{i}", out.prompt_token_ids,
                                      params.engine_params(i, max_tokens, fmt)) for i in range(params.n)]
            for i, r in enumerate(reqs):
                out.outputs.append(CompletionOutput(i, "", [], "", 0.0 if params.logprobs is not None else None,
                                                    [] if params.logprobs is not None else None))
                samples[r.request_id] = (out, out.outputs[i])
            engine.add_request(reqs[0])
            followers[reqs[0].request_id] = reqs[1:]
        error: KvsealError | None = None
        while engine.has_work():
            for d in engine.step():
                for r in followers.pop(d.request_id, []):  # sample 0's prompt is computed and cached
                    engine.add_request(r)
                out, c = samples[d.request_id]
                c.text += d.text
                c.token_ids += d.token_ids
                for lp in d.logprobs or []:
                    assert c.logprobs is not None and c.cumulative_logprob is not None
                    c.logprobs.append({lp.token_id: lp.logprob, **dict(lp.top)})
                    c.cumulative_logprob += lp.logprob
                if d.final is not None:
                    c.finish_reason = d.final
                    out.num_cached_tokens += d.cached_tokens
                    if d.error is not None and error is None:
                        error = KvsealError.from_info(d.error)
        if error is not None:
            raise error
