"""The parts of a `scheduler.Sequence` that the scheduler does not own, one dataclass per owner:

- `OutputState` (`seq.out`): what the request has produced and been told. Written by
  `output_processor.OutputProcessor`, which takes the per-token values the step leaves in `step_*`
  (`step_extras.StepExtras.deliver`) and the prefill's raw logits (`runner.Runner.prefill`).
- `GuideState` (`seq.guide`): the request's guide, its compile and the compiled grammar. Written by
  `intake.Intake` only (start, collect, cancel the compile).
- `SeqStats` (`seq.stats`): timestamps and speculative counters for the perf metrics; each field
  has one writer, named beside it.

Plain data: the imports below are for type checkers only, so this module imports nothing at run time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

    from ..guided.backend import CompiledGuide
    from ..guided.compiler import CompileHandle
    from ..request import GuidedDecodingParams


@dataclass(eq=False, slots=True)
class OutputState:
    """Owned by output_processor.OutputProcessor: per-token values, and what was sent to the callback."""

    ids_sent: int = 0  # output tokens already reported
    # per-token outputs for requests that ask: the step leaves this step's values in step_* (aligned
    # with the tokens it returned: StepExtras.deliver); append keeps those of the tokens it appends
    step_logprobs: Optional[list[float]] = None
    step_top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    step_logits: Optional[torch.Tensor] = None  # [tokens, vocab] raw logits, float32 on the CPU
    logprobs: list[float] = field(default_factory=list)  # per output token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    logits_unsent: list[torch.Tensor] = field(default_factory=list)  # raw logits rows of output tokens not yet reported
    context_logits: list[torch.Tensor] = field(default_factory=list)  # prefill chunks' raw logits, until reported
    prompt_logprobs: Optional[list] = field(default_factory=list)  # prompt tokens 1.. (PromptLogprob); None once reported
    # set by OutputProcessor.close as the request finishes
    stage: Optional[str] = None  # where it was: queued|compiling|prefill|decode
    error_code: Optional[str] = None


@dataclass(eq=False, slots=True)
class GuideState:
    """Owned by intake.Intake: a guided request's guide, its compile while it runs, then the grammar."""

    params: Optional[GuidedDecodingParams] = None  # None: not a guided request
    compile: Optional[CompileHandle] = None  # while the grammar compiles
    grammar: Optional[CompiledGuide] = None  # once ready (wrapped for reasoning models / the token budget)


@dataclass(eq=False, slots=True)
class SeqStats:
    """Timestamps and speculative counters, reported in the perf metrics of each event."""

    arrival: float = field(default_factory=time.monotonic)  # the request's deadline and faults count from it
    arrival_time_ns: int = field(default_factory=time.time_ns)  # wall clock (time.time_ns(); 0 = not yet)
    first_scheduled_time_ns: int = 0  # Scheduler.schedule, at admission
    first_token_time: Optional[float] = None  # time.monotonic(); OutputProcessor.append, as are the next two
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    num_draft: int = 0  # speculative decoding: draft tokens proposed / accepted so far (EngineCore._decode_batch)
    num_accepted: int = 0
