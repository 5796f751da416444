"""What one step is told and what it tells back: the drafting mode, and named views of the step's
packed int64 buffers (one host->device copy in, one device->host copy out).

The views are rows of one buffer (numpy arrays or torch tensors alike), so writing a view writes
the buffer that the step copies as a whole; the CUDA graphs capture the same storage.
"""
from __future__ import annotations

import enum
from typing import Any


class Drafting(str, enum.Enum):
    """Where one step's drafts come from (StepKey.drafting)."""

    NONE = "none"  # plain decode: one position per row
    HOST = "host"  # drafts known before the step (n-gram, grammar chains), staged in the drafts rows
    MODEL = "model"  # T - 1 forwards of a device drafter inside the step, each masked by its grammar row
    UNMASKED = "unmasked"  # the same without masks (the mask_drafts=False ablation), walked after the last

    @property
    def in_step(self) -> bool:
        """The drafts are made inside the step by a device drafter."""
        return self in (Drafting.MODEL, Drafting.UNMASKED)


class StepInputs:
    """The step's inputs [ROWS, S], per batch row: the last token, the position of the first token
    fed (pos0), the slot, the output index of the next token (counter: the sampling noise's), and
    the drafts to verify (num)."""

    ROWS = 5

    def __init__(self, buf: Any):
        self.buf = buf
        self.last, self.pos0, self.slot, self.counter, self.num = (buf[i] for i in range(self.ROWS))


class StepOutputs:
    """The step's outputs [2 + K, S], per batch row: the drafts accepted, the next token (the
    correction or the bonus), and draft i in `drafts[i]` ([K, S])."""

    def __init__(self, buf: Any):
        self.buf = buf
        self.accepted, self.next, self.drafts = buf[0], buf[1], buf[2:]

    @staticmethod
    def rows(max_draft_tokens: int) -> int:
        return 2 + max_draft_tokens
