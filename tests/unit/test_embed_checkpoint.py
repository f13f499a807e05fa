"""What kvseal reads from a sentence-transformers folder (kvseal/embed/folder.py, embed/checkpoint.py): the
pooling and normalization its modules name, each pooling mode over packed inputs equal to the padded computation
sentence-transformers does, and folders with modules kvseal does not have refused with what they hold; and
/v1/embeddings' input shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from kvseal.api.embeddings_protocol import EmbeddingRequest
from kvseal.embed.checkpoint import pool
from kvseal.embed.folder import Pipeline

T, N, O = "sentence_transformers.models.Transformer", "sentence_transformers.models.Normalize", "1_Pooling"


def folder(tmp: Path, modules: list[dict[str, Any]], pooling: dict[str, Any], max_seq: int | None = 128) -> Path:
    (tmp / O).mkdir(parents=True)
    (tmp / "modules.json").write_text(json.dumps(modules))
    (tmp / O / "config.json").write_text(json.dumps({"word_embedding_dimension": 4, **pooling}))
    if max_seq is not None:
        (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq}))
    return tmp


POOL = {"type": "sentence_transformers.models.Pooling", "path": O}


@pytest.mark.parametrize("mode", ["cls", "mean", "max", "mean_sqrt_len", "last"])
def test_each_pooling_over_packed_inputs_equals_the_padded_computation(tmp_path: Path, mode: str) -> None:
    key = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
           "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "last": "pooling_mode_lasttoken"}[mode]
    p = Pipeline.read(folder(tmp_path, [{"type": T}, POOL], {key: True}), max_position=512)
    assert (p.pooling, p.normalize, p.max_tokens) == (mode, False, 128)
    lengths = torch.tensor([3, 1, 5])
    hidden = torch.randn(int(lengths.sum()), 4)
    want = []
    for x in torch.split(hidden, lengths.tolist()):
        want.append({"cls": x[0], "mean": x.mean(0), "max": x.max(0).values, "last": x[-1],
                     "mean_sqrt_len": x.sum(0) / len(x) ** 0.5}[mode])
    assert torch.allclose(pool(p, hidden, lengths), torch.stack(want), atol=1e-6)


def test_normalize_and_the_longest_input_come_from_the_folder(tmp_path: Path) -> None:
    p = Pipeline.read(folder(tmp_path, [{"type": T}, POOL, {"type": N}], {"pooling_mode_mean_tokens": True},
                             max_seq=1024), max_position=512)
    assert p.normalize and p.max_tokens == 512  # capped by the model's positions
    out = pool(p, torch.randn(6, 4) * 7, torch.tensor([2, 4]))
    assert torch.allclose(out.norm(dim=1), torch.ones(2))


@pytest.mark.parametrize("modules,pooling,says", [
    ([{"type": T}, POOL, {"type": "sentence_transformers.models.Dense"}], {"pooling_mode_mean_tokens": True},
     "Dense"),
    ([{"type": T}, POOL], {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "exactly one"),
    ([{"type": T}, POOL], {"pooling_mode_weightedmean_tokens": True}, "weightedmean"),
])
def test_a_folder_with_what_kvseal_does_not_have_is_refused_naming_it(tmp_path: Path, modules: list[Any],
                                                                       pooling: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Pipeline.read(folder(tmp_path, modules, pooling), max_position=512)
    with pytest.raises(ValueError, match="no modules.json"):
        Pipeline.read(tmp_path / O, max_position=512)


def test_the_four_input_shapes_and_the_rest_refused_as_input() -> None:
    def body(v: Any) -> EmbeddingRequest:
        return EmbeddingRequest.model_validate({"model": "m", "input": v})

    assert body("a").texts() == ["a"] and body(["a", "b"]).texts() == ["a", "b"]
    assert body([1, 2]).token_ids() == [[1, 2]] and body([[1], [2, 3]]).token_ids() == [[1], [2, 3]]
    for bad in ([], [1, "a"], [[]], [[1, "x"]], [True], 5, [-1], ["a"] * 2049, [[2**40]]):
        with pytest.raises(ValidationError) as err:
            body(bad)
        assert [e["loc"] for e in err.value.errors()] == [("input",)], bad
