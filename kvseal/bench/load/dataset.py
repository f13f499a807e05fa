"""The prompts of a run: fixed or random lengths from seeded token ids (or words, for chat), or a jsonl file.

Pure given a seed: the same config gives the same prompts, lengths and order, so passes and runs compare.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvseal.bench.load.config import BenchConfig

# Without a tokenizer, ids come from here: above the special and byte tokens of common vocabularies and
# below the vocabulary size of any model one would benchmark.
DEFAULT_ID_RANGE = (1000, 20000)

# Chat prompts are text; N of these words is roughly N tokens for most BPE vocabularies.
_WORD_TEXT = """time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number night point
home water room mother area money story fact month lot right study book eye job word business issue side kind
head house service friend father power hour game line end member law car city community name president team
minute idea kid body information back parent face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education"""
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class Prompt:
    prompt: str | list[int]  # token ids go to /v1/completions as they are: the exact input length
    input_len: int | None  # tokens; the word count for word prompts; None when unknown (jsonl, no tokenizer)
    output_len: int


class Tokenizer:
    """Just what the dataset needs from the served model's tokenizer (Hugging Face `tokenizers`)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._tok = HfTokenizer.from_file(file)
        self.base_vocab = self._tok.get_vocab_size(with_added_tokens=False)  # added/special tokens sit above

    def id_range(self) -> tuple[int, int]:
        return min(DEFAULT_ID_RANGE[0], self.base_vocab // 4), self.base_vocab

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


def lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    """n lengths uniform over the integers in [mean*(1-ratio), mean*(1+ratio)] (never below 1)."""
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def synthetic(n: int, input_lens: Sequence[int], output_lens: Sequence[int], chat: bool,
              tokenizer: Tokenizer | None, rng: random.Random) -> list[Prompt]:
    lo, hi = tokenizer.id_range() if tokenizer else DEFAULT_ID_RANGE
    out = []
    for i in range(n):
        if not chat:
            out.append(Prompt([rng.randrange(lo, hi) for _ in range(input_lens[i])], input_lens[i], output_lens[i]))
        elif tokenizer is not None:
            text = tokenizer.decode([rng.randrange(lo, hi) for _ in range(input_lens[i])])
            out.append(Prompt(text, tokenizer.count(text), output_lens[i]))
        else:
            out.append(Prompt(" ".join(rng.choice(WORDS) for _ in range(input_lens[i])), input_lens[i],
                              output_lens[i]))
    return out


def with_prefixes(cfg: BenchConfig, n: int, tokenizer: Tokenizer | None) -> list[Prompt]:
    """Prompt i: head i mod --num-prefixes (--prefix-len tokens) + its own --suffix-len tokens (a repeated system
    prompt or few-shot template: what a prefix cache is for). Chat prompts join the two with a space."""
    chat = cfg.endpoint == "chat"
    heads = synthetic(cfg.num_prefixes, [cfg.prefix_len] * cfg.num_prefixes, [cfg.output_len] * cfg.num_prefixes,
                      chat, tokenizer, random.Random(f"prefixes/{cfg.seed}"))
    tails = synthetic(n, [cfg.suffix_len] * n, [cfg.output_len] * n, chat, tokenizer,
                      random.Random(f"suffixes/{cfg.seed}"))
    out = []
    for i, tail in enumerate(tails):
        head = heads[i % len(heads)]
        if isinstance(head.prompt, list) and isinstance(tail.prompt, list):
            out.append(Prompt(head.prompt + tail.prompt, cfg.prefix_len + cfg.suffix_len, cfg.output_len))
        else:
            text = f"{head.prompt} {tail.prompt}"
            out.append(Prompt(text, tokenizer.count(text) if tokenizer else cfg.prefix_len + cfg.suffix_len,
                              cfg.output_len))
    return out


def _row_problem(obj: Any) -> str | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        return 'expected an object with a string "prompt"'
    out_len = obj.get("output_len", 1)
    if not isinstance(out_len, int) or isinstance(out_len, bool) or out_len < 1:
        return f'"output_len" must be a whole number >= 1, got {out_len!r}'
    return None


def parse_jsonl(lines: Sequence[str], default_output_len: int) -> list[tuple[str, int]]:
    """(prompt, output_len) per non-blank line; a bad line is a ValueError naming its number."""
    rows = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"line {no}: not JSON ({exc})") from exc
        problem = _row_problem(obj)
        if problem:
            raise ValueError(f"line {no}: {problem}")
        rows.append((obj["prompt"], obj.get("output_len", default_output_len)))
    if not rows:
        raise ValueError("no prompts in the file")
    return rows


def slices(pass_sizes: Sequence[int], warmup: int, fresh: bool) -> tuple[list[int], list[range]]:
    """(the warm-up's prompt indices, each pass's index range) into a list of max(ends) prompts.

    By default every pass starts at prompt 0 and the warm-up resends the first prompts. `fresh`: the passes
    take consecutive ranges and the warm-up the prompts after them, so no prompt is sent twice."""
    if not fresh:
        return [i % max(pass_sizes) for i in range(warmup)], [range(n) for n in pass_sizes]
    ranges, start = [], 0
    for n in pass_sizes:
        ranges.append(range(start, start + n))
        start += n
    return list(range(start, start + warmup)), ranges


def build(cfg: BenchConfig, n: int) -> list[Prompt]:
    """The first n prompts of the run (every pass takes its prompts from the front of this list)."""
    tokenizer = Tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    if cfg.dataset == "jsonl":
        assert cfg.dataset_path is not None  # config_from_args checks it
        with open(cfg.dataset_path, encoding="utf-8") as f:
            try:
                rows = parse_jsonl(f.read().splitlines(), cfg.output_len)
            except ValueError as exc:
                raise ValueError(f"{cfg.dataset_path}: {exc}") from exc
        picked = [rows[i % len(rows)] for i in range(n)]
        return [Prompt(text, tokenizer.count(text) if tokenizer else None, out) for text, out in picked]
    if cfg.dataset == "prefix":
        return with_prefixes(cfg, n, tokenizer)
    # one generator per stream, each drawn in prompt order: the first k prompts do not depend on n
    ratio = cfg.range_ratio if cfg.dataset == "random" else 0.0
    ins = lengths(n, cfg.input_len, ratio, random.Random(f"input-len/{cfg.seed}"))
    outs = lengths(n, cfg.output_len, ratio, random.Random(f"output-len/{cfg.seed}"))
    return synthetic(n, ins, outs, cfg.endpoint == "chat", tokenizer, random.Random(f"tokens/{cfg.seed}"))
