"""The embedding model computed: the BERT encoder (model/bert.py) over the folder's weights, then the pooling and
normalization its sentence-transformers config names (embed/folder.py reads them), as sentence-transformers does."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kvseal.embed.folder import EmbedFolder, Pipeline
from kvseal.model.bert import BertEncoder


def pool(pipe: Pipeline, hidden: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(T, H) packed token states of B inputs -> (B, H), as sentence-transformers' Pooling and Normalize."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # (T,): each token's input
    if pipe.pooling in ("mean", "mean_sqrt_len"):
        sums = hidden.new_zeros(len(lengths), hidden.shape[1]).index_add_(0, segment, hidden)
        out = sums / (lengths.sqrt() if pipe.pooling == "mean_sqrt_len" else lengths)[:, None].to(hidden.dtype)
    elif pipe.pooling == "max":
        out = hidden.new_empty(len(lengths), hidden.shape[1]).scatter_reduce_(
            0, segment[:, None].expand_as(hidden), hidden, "amax", include_self=False)
    else:
        starts = torch.cumsum(lengths, 0) - lengths
        out = hidden[starts if pipe.pooling == "cls" else starts + lengths - 1]
    return F.normalize(out, p=2, dim=1) if pipe.normalize else out


class EmbedModel(EmbedFolder):
    """Token ids -> embeddings (float32 numpy, (B, dim)), as sentence-transformers computes them."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.encoder = BertEncoder(self.arch, load_file(str(self.folder / "model.safetensors")))

    def embed(self, ids: list[list[int]]) -> np.ndarray:
        hidden, lengths = self.encoder.forward(ids)
        return pool(self.pipeline, hidden, lengths).numpy()
