"""What one step verifies (DraftPlan) and the interface of drafters that run inside the step."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from ..models.llama import AttnContext
from ..engine.scheduler import Sequence
from ..engine.step_layout import Drafting

Ctx = Callable[[torch.Tensor, int], AttnContext]  # (positions [B, T], extra keys) -> attention context


class Drafter(Protocol):
    """A drafter that runs inside the step (its forwards capturable)."""

    d2t: Optional[torch.Tensor]  # [Vd] draft id -> target id (pruned draft vocabulary), or None

    def prepare(self, seqs: list[Sequence], key: Any) -> None:
        """Host, before the step: catch-up forwards, staging of the drafter's own inputs."""

    def draft(self, i: int, cur: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor, ctx: Ctx) -> torch.Tensor:
        """In the step: logits [B, Vd] of draft i from the previous tokens cur [B, 1]."""

    def done(self, seqs: list[Sequence], accepted: list[int], width: int) -> None:
        """Host, after the step (before the append): `width` drafts were fed per row."""


@dataclass
class DraftPlan:
    """What one step verifies: per-row budgets and where the drafts come from."""

    ks: list[int]
    drafts: Optional[list[list[int]]] = None  # host drafts
    drafter: Optional[Drafter] = None  # drafts made in the step
    picker: Any = None  # hybrid proposals (speculative.hybrid.HybridPicks)
    masked: bool = True  # grammar masks while drafting (off: the ablation)

    @property
    def drafting(self) -> Drafting:
        if self.drafts is not None:
            return Drafting.HOST if any(self.drafts) else Drafting.NONE
        if self.drafter is None or not any(self.ks):
            return Drafting.NONE
        return Drafting.MODEL if self.masked else Drafting.UNMASKED

    @property
    def width(self) -> int:
        """Drafts per row in the step (T - 1)."""
        d = self.drafting
        if d is Drafting.NONE:
            return 0
        return max(len(x) for x in self.drafts) if d is Drafting.HOST else max(self.ks)
