"""Batched sampling (greedy, temperature, top-k, top-p, min-p, per-request seed) with no host syncs.

Randomness is counter-based: the uniform for (row, vocab entry) is a hash of the request's seed,
the token's index in the request and a stream id. A request's samples therefore depend only on
its own seed and position, never on which other requests share the batch, and the whole thing is
plain tensor arithmetic (capturable in a CUDA graph)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels

M32 = 0xFFFFFFFF
U_MAX = 1.0 - 2.0 ** -24  # the largest float32 below 1


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on int64 tensors holding values in [0, 2^32)."""
    # NOTE: int64 products wrap around; only the low 32 bits are kept, which is all we need
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor, n: int, stream: int = 0) -> torch.Tensor:
    """Uniforms in (0, 1): [B, n] for seeds [B] (uint64 as int64) and counters [B] (int64)."""
    lo, hi = seed & M32, (seed >> 32) & M32
    key = hash32(lo ^ hash32(hi ^ hash32((counter * 2654435761 + stream * 40503) & M32)))  # [B]
    idx = torch.arange(n, device=seed.device, dtype=torch.int64)
    bits = hash32(hash32((key[:, None] ^ (idx[None, :] * 0x9E3779B1)) & M32) ^ key[:, None])  # [B, n]
    # NOTE: float32 rounds the top ~128 of 2^32 values to 1.0 (about 1 in 700 rows of 49k draws); a
    # uniform of 1 makes the Gumbel noise -log(-log u) infinite: NaN / +inf argmax on any token
    return (bits.double() + 0.5).mul_(1.0 / 4294967296.0).float().clamp_(max=U_MAX)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built by the runner from host-side values."""

    temperature: torch.Tensor  # [B] f32 (> 0 for sampled rows)
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] f32, 1.0 = off
    min_p: torch.Tensor  # [B] f32, 0.0 = off
    greedy: torch.Tensor  # [B] bool
    seed: torch.Tensor  # [B] int64
    counter: torch.Tensor  # [B] int64: index of the token being sampled within its request
    all_greedy: bool  # host-side facts that let us skip work (known at schedule time)
    any_truncation: bool  # a sampled row uses top-k, top-p or min-p


def filter_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> temperature-scaled logits with entries outside top-k / min-p / top-p at -inf
    (vLLM's order: top-k and min-p, which commute, then top-p over what they keep)."""
    temp = torch.where(b.greedy, torch.ones_like(b.temperature), b.temperature)
    logits = logits / temp[:, None]
    if not b.any_truncation:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    V = logits.shape[-1]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, V))
    drop = rank >= k[:, None]
    # min-p: p_i < min_p * p_max  <=>  l_i - l_max < log(min_p) (log 0 = -inf drops nothing)
    drop |= (sorted_logits - sorted_logits[:, :1]) < b.min_p.log()[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop |= (probs.cumsum(dim=-1) - probs) >= b.top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits [B, V] (fp32, already masked) -> tokens [B] int64."""
    greedy_tokens = kernels.argmax(logits)
    if b.all_greedy:
        return greedy_tokens
    scaled = filter_logits(logits, b)
    # Gumbel-max: argmax(l + g), g = -log(-log u), is a sample from softmax(l)
    u = uniform(b.seed, b.counter, logits.shape[-1])
    sampled = kernels.argmax(scaled - torch.log(-torch.log(u)))
    return torch.where(b.greedy, greedy_tokens, sampled)


def log_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Log-probabilities [B, V] reported for emitted tokens: sampled rows, the distribution `sample`
    draws from (temperature-scaled, top-k/min-p/top-p filtered and renormalized); greedy rows,
    log_softmax of the logits (temperature 1, no filtering)."""
    if b.all_greedy:
        return logits.log_softmax(dim=-1)
    return torch.where(b.greedy[:, None], logits, filter_logits(logits, b)).log_softmax(dim=-1)
