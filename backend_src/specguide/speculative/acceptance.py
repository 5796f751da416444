"""Batched verification of draft tokens, no host syncs: a draft is accepted while it equals the
token the target itself emits at its position.

The target's token at each verified position is what a step without drafts would emit there:
the argmax (greedy rows) or `engine.sampler.sample`, whose noise is a hash of the request's seed and the
token's index in the request (sampled rows). So the output is the speculation-off output token
for token, greedy or seeded, whatever K, drafter, cost-aware choice or batch the step had: each
emitted token is drawn from the target's (masked, filtered) distribution, never from a draft's.
For a deterministic draft d (all of ours: n-gram, grammar-forced, the draft head's argmax)
acceptance happens with probability p(d), as rejection sampling (Leviathan et al. 2023) with a
one-hot draft distribution would accept it; rejection sampling would also make the emitted
token depend on the draft (through its acceptance draw and residual), so a seeded request's
output would change with K."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import kernels


def accept(target: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target [B, K+1]: the target's token at each verified position; drafts [B, K] int64;
    num_drafts [B]: valid drafts per row.

    Returns (accepted [B]: the length of the prefix of drafts equal to the target's tokens,
    next_token [B]: the target's token right after it: the correction, or the bonus token)."""
    B, T = target.shape
    K = T - 1
    assert drafts.shape == (B, K)
    ok = (drafts == target[:, :K]) & (torch.arange(K, device=target.device)[None, :] < num_drafts[:, None])
    accepted = ok.int().cumprod(dim=1).sum(dim=1)
    return accepted, target.gather(1, accepted.long()[:, None])[:, 0]


def verify(logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
           sample: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The verification of logits [B, K+1, V] (masked): the target's token at each position is
    its argmax (a greedy batch: `sample` None) or `sample(logits)` [B, K+1], the token a step
    without drafts samples there; then `accept`."""
    target = kernels.argmax(logits) if sample is None else sample(logits)
    return accept(target, drafts, num_drafts)
