"""Batched verification of draft tokens: greedy and rejection sampling, no host syncs.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) with target distribution p and
draft distribution q at each draft position i:
    accept d_i with probability min(1, p(d_i) / q(d_i))
    at the first rejection, emit a token from norm(max(p - q, 0)); if all k drafts are accepted,
    emit a bonus token from p at position k.
The emitted sequence is distributed exactly as sampling from p token by token. A deterministic
drafter (n-gram, greedy drafts) has q = one-hot(d_i): accept with probability p(d_i), and the
residual is p with d_i removed. Greedy rows have p = one-hot(argmax): accept iff d_i == argmax,
then emit the argmax - plain greedy decoding, token for token."""
from __future__ import annotations

from typing import Optional

import torch

from .. import sampling


def verify(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, u_accept: torch.Tensor,
           u_resample: torch.Tensor, q: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """p [B, K+1, V] target probabilities (masked, filtered); drafts [B, K] int64; num_drafts [B]
    valid drafts per row; u_accept [B, K] and u_resample [B, K+1, V] uniforms in (0, 1);
    q [B, K, V] draft probabilities or None (one-hot drafts).

    Returns (accepted [B]: drafts accepted, next_token [B]: the corrected / bonus token)."""
    B, T, V = p.shape
    K = T - 1
    assert drafts.shape == (B, K) and u_accept.shape == (B, K)
    d = drafts.clamp(min=0)
    p_d = p[:, :K].gather(-1, d[..., None])[..., 0]  # [B, K]
    q_d = torch.ones_like(p_d) if q is None else q.gather(-1, d[..., None])[..., 0]
    ok = u_accept < torch.clamp(p_d / q_d.clamp_min(1e-20), max=1.0)
    ok &= torch.arange(K, device=p.device)[None, :] < num_drafts[:, None]
    accepted = ok.int().cumprod(dim=1).sum(dim=1)  # [B]: length of the accepted prefix
    # distribution of the emitted token at position `accepted`
    rows = torch.arange(B, device=p.device)
    p_a = p[rows, accepted]  # [B, V]
    if q is None:
        d_pad = torch.cat([d, torch.zeros_like(d[:, :1])], dim=1)  # [B, K+1]
        q_a = torch.zeros_like(p_a).scatter_(-1, d_pad[rows, accepted][:, None], 1.0)
    else:
        q_a = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]  # bonus position: q = 0
    rejected = accepted < num_drafts  # else: all drafts accepted, bonus from p
    residual = torch.where(rejected[:, None], (p_a - q_a).clamp_min(0.0), p_a)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)  # p == q: any token of p
    u = u_resample[rows, accepted]  # [B, V]
    # Gumbel-max over log(residual): a sample from the normalized residual
    logr = torch.where(residual > 0, residual.log(), torch.full_like(residual, float("-inf")))
    next_token = (logr - torch.log(-torch.log(u))).argmax(dim=-1)
    return accepted, next_token


def uniforms(seed: torch.Tensor, counter: torch.Tensor, K: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counter-based uniforms for a verification step starting at output index `counter`:
    ([B, K] acceptance tests, [B, K+1, V] resampling noise). Independent of the batch."""
    B = seed.shape[0]
    steps = counter[:, None] + torch.arange(K + 1, device=seed.device)[None, :]  # [B, K+1]
    flat_seed = seed[:, None].expand(B, K + 1).reshape(-1)
    u_res = sampling.uniform(flat_seed, steps.reshape(-1), V, stream=0).view(B, K + 1, V)
    u_acc = sampling.uniform(flat_seed, steps.reshape(-1), 1, stream=1).view(B, K + 1)[:, :K]
    return u_acc, u_res
