"""benchmarks/embeddings.py's pure parts: the workload (64 seeded sentences of 32 to 128 tokens) and its table."""

from __future__ import annotations

from pathlib import Path

from benchmarks.embeddings import sentences, table
from kvseal.embed.folder import load_tokenizer
from tests.helpers.real_models import real_model


def test_the_workload_is_64_seeded_sentences_of_32_to_128_tokens() -> None:
    tok = load_tokenizer(Path(real_model("all-minilm-l6-v2")))
    texts = sentences(tok)
    lengths = [len(tok.encode(t).ids) for t in texts]
    assert len(texts) == 64 and min(lengths) >= 32 and max(lengths) <= 128  # each word is one vocabulary entry
    assert sentences(tok) == texts and sentences(tok, seed=1) != texts


def test_the_table_gives_each_systems_ratio_to_llama_server() -> None:
    run = {"threads": 1, "texts_per_s": {"kvseal": [30.0, 32.0], "llama-server": [20.0]},
           "median": {"kvseal": 31.0, "llama-server": 20.0}, "median_per_cpu_s": {"kvseal": 60.0, "llama-server": 40.0},
           "cosine_min_vs_sentence_transformers": {"kvseal": 1.0, "llama-server": 0.99999}}
    rows = table([run]).splitlines()
    assert rows[2] == "| 1 | kvseal | 31.0 | 30.0 / 32.0 | 1.55x | 60.0 | 1.50x | 1.0000000 |"
    assert "| 1.00x |" in rows[3]
