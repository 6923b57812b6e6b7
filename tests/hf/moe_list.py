"""A mixture-of-experts model whose experts are a ``ModuleList`` of expert MLPs, as older
and custom models hold them (`Routing.CALLS`): a router ``gate`` [E, H] beside the list, the
block calling each routed expert, in index order, on its tokens and summing the weighted
outputs (Mixtral's older code)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Expert", "ListMoe", "ListMoeModel", "SparseBlock"]


class Expert(nn.Module):
    """One SwiGLU expert: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class SparseBlock(nn.Module):
    """Top-k routing over a ``ModuleList`` of experts."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden, inner) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.gate(flat), dim=-1), self.top_k, dim=-1)
        out = torch.zeros_like(flat)
        for j in torch.unique(chosen).tolist():  # the routed experts, in index order
            rows, which = torch.nonzero(chosen == j, as_tuple=True)
            out.index_add_(0, rows, self.experts[j](flat[rows]) * weights[rows, which, None])
        return out.reshape(x.shape)


class ListMoe(nn.Module):
    """A layer: a dense mixing weight, then the sparse block, both residual."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.mix = nn.Linear(hidden, hidden)
        self.block_sparse_moe = SparseBlock(hidden, inner, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.mix(x))
        out: torch.Tensor = x + self.block_sparse_moe(x)
        return out


class ListMoeModel(nn.Module):
    """`layers` such layers over an embedding of 64 tokens."""

    def __init__(self, layers: int = 3, *, hidden: int = 16, inner: int = 24, experts: int = 8, top_k: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(64, hidden)
        self.layers = nn.ModuleList(ListMoe(hidden, inner, experts, top_k) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x
