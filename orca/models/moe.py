"""Mixture of experts (Mixtral, Qwen3-MoE): selective batching's natural extension. The router scores the
whole flattened [tokens, hidden] batch at once; each token goes to its top-k experts; the (token, expert)
pairs are sorted by expert once, and each expert runs one SwiGLU matmul over every token routed to it,
whatever request and phase the tokens belong to. One Python iteration per expert, never per token.

Under tensor parallelism every rank routes the same way (the router is replicated) and holds I/tp of each
expert (gate/up rows, down columns): its sum over the experts is a partial sum, all-reduced once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from orca.parallel import ParallelContext


class SparseMoE(nn.Module):
    """Top-k routing over `num_experts` SwiGLU experts. Expert weights are stacked at load time:
    gate_up_proj is (E * 2I, H) (each expert's gate rows, then its up rows), down_proj (E * H, I), where I is
    this rank's share of an expert's intermediate size."""

    def __init__(
        self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
        par: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.par = par
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden, self.intermediate = hidden, intermediate
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden, intermediate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, H)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        flat = experts.flatten()  # (T * k,): pair p is token p // k's choice p % k
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k  # (T * k,) token of each pair, expert-major
        routed = x.index_select(0, tokens)  # (T * k, H)
        pair_weights = weights.flatten().index_select(0, order)[:, None]  # (T * k, 1)
        gate_up = self.gate_up_proj.view(self.num_experts, 2 * self.intermediate, self.hidden)
        down = self.down_proj.view(self.num_experts, self.hidden, self.intermediate)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            g, u = F.linear(routed[start:end], gate_up[e]).chunk(2, dim=-1)  # (n, I) each
            y = F.linear(F.silu(g) * u, down[e]) * pair_weights[start:end]  # (n, H)
            out.index_add_(0, tokens[start:end], y)
            start = end
        if self.par is not None:
            self.par.all_reduce(out)  # each rank's experts held I/tp of their rows: partial sums
        return out
