"""A SentencePiece-style GGUF tokenizer (`tokenizer.ggml.model == "llama"`: Gemma, Llama 2, Mistral) as a
`tokenizers` BPE with byte fallback, built as transformers builds it from the same file
(integrations/gguf/gguf_tokenizer_mapping.py: `sentencepiece_tokenizer`, `gemma_tokenizer`), so `encode` gives the
ids of `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
  * vocab: the tokens as stored; Gemma's tokens made only of spaces are respelled with "▁" (its merges use those);
  * merges: the file's, or (SentencePiece files carry none) rebuilt from the vocabulary: every split of a token
    into two tokens, best first by score (Gemma: by the token's position in the file, which is its merge order).
    Rebuilding takes seconds for a large vocabulary (Gemma 3: 262,144 tokens, 514,906 merges, ~4 s), so the result
    is kept in the weights cache folder under a digest of what it is computed from (tokens, scores), written once
    (temp + rename), and rebuilt whenever the file is missing, unreadable or names another digest;
  * Gemma: spaces become "▁" in a normalizer, text is split after each space, no prefix space;
    others (LlamaTokenizer): Metaspace with a "▁" prepended to the first word, stripped again on decode;
  * control tokens (type 3) and bos/eos/unk/pad are special added tokens, user-defined ones (type 4) plain ones.
"""

from __future__ import annotations

import hashlib
import logging
from array import array

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
SPACE = "\u2581"
_CONTROL, _USER_DEFINED = 3, 4


def rebuild_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' `generate_merges(vocab, scores)`: each token's splits into two vocabulary tokens, ordered by
    (score, left length, right length) best first; ties keep the tokens' order, then the parts' ids."""
    merges: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def cached_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """rebuild_merges, kept in `<weights cache>/tokenizer/merges-<digest>.txt` (the digest of the tokens, their ids
    and scores in order: the whole input of rebuild_merges). The file: "DIGEST PAIRS LENGTH", a newline, a separator
    character that no merge part holds, a newline, then every merge's two parts joined by that separator (LENGTH
    characters: a file cut short is rebuilt, never read as fewer merges)."""
    from kvseal.model.file_index import file_lock, weights_cache_dir, write_atomic

    tokens = list(scores)
    h = hashlib.sha256(b"kvseal-spm-merges-v1")
    h.update(array("I", map(len, tokens)).tobytes())  # the lengths first: no two vocabularies hash alike
    h.update("".join(tokens).encode("utf-8", "surrogatepass"))
    h.update(array("q", [vocab[t] for t in tokens]).tobytes())
    h.update(array("d", scores.values()).tobytes())
    h.update(str(len(vocab)).encode())
    digest = h.hexdigest()
    folder = weights_cache_dir() / "tokenizer"
    folder.mkdir(exist_ok=True)
    path = folder / f"merges-{digest[:32]}.txt"
    with file_lock(folder / f"merges-{digest[:32]}.lock"):  # workers that start together build it once
        try:
            head, sep, _, body = _split_header(path.read_text(encoding="utf-8", errors="surrogatepass"))
            parts = body.split(sep) if body else []
            if head == f"{digest} {len(parts) // 2} {len(body)}" and len(parts) % 2 == 0:
                return list(zip(parts[0::2], parts[1::2]))
        except (OSError, ValueError):
            pass  # missing, damaged or another digest's: rebuilt below
        merges = rebuild_merges(vocab, scores)
        parts = [x for pair in merges for x in pair]
        everything = "".join(parts)
        free = next((c for c in map(chr, range(0xE000, 0xF900)) if c not in everything), None)
        if free is None:  # every private-use character is in the vocabulary: nothing to separate with
            return merges
        try:
            body = free.join(parts)
            write_atomic(path, f"{digest} {len(merges)} {len(body)}\n{free}\n{body}".encode("utf-8", "surrogatepass"))
        except OSError as exc:  # a read-only cache: rebuilt at every start, still right
            logging.getLogger("kvseal.model").warning("could not keep the tokenizer's merges in %s: %s", path, exc)
        return merges


def _split_header(text: str) -> tuple[str, str, str, str]:
    head, nl, rest = text.partition("\n")
    sep, nl2, body = rest[:1], rest[1:2], rest[2:]
    if not nl or nl2 != "\n" or not sep:
        raise ValueError("not a merges cache file")
    return head, sep, nl2, body


def spm_backend(arch: str, tokens: list[str], scores: list[float], token_types: list[int],
                merges: list[str] | None, specials: list[int]) -> tokenizers.Tokenizer:
    """The `tokenizers` backend; specials: the ids of bos/eos/unk/pad the file names (added as special)."""
    gemma = arch in GEMMA_ARCHS
    if gemma:
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
        bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
        if bad is not None:
            raise ValueError(f"GGUF tokenizer.ggml.merges entry {bad!r} is not two tokens separated by one space")
        merge_pairs = [(p[0], p[1]) for p in pairs]
    else:
        if not gemma and len(scores) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens; a "
                             "SentencePiece vocabulary without merges needs one score per token")
        by: dict[str, float] = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores))
        merge_pairs = cached_merges(vocab, by)
    unk = "<unk>" if "<unk>" in vocab else None
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=True, unk_token=unk,
                                              dropout=None, byte_fallback=True))
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
        backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(content=" ", left=1)])
    special = [tokens[i] for i in specials]
    special += [t for t, ty in zip(tokens, token_types) if ty == _CONTROL and t not in special]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    user = [t for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend
