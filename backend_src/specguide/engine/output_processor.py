"""Output processing: appending a step's tokens to a request, its stop conditions, and the events
its callback receives (token ids: their text and stop strings are made where the events are read,
text_stream.py)."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from ..request import RequestOutput
from .scheduler import Sequence, Status
from .step_extras import bad_word_bans

log = logging.getLogger("specguide")
STAGES = {Status.WAITING: "queued", Status.PREFILL: "prefill", Status.DECODE: "decode",
          Status.PREEMPTED: "preempted", Status.FINISHED: "finished"}


class Finish(NamedTuple):
    """Why a request ends: a finish reason and, for "error", the client's message and code."""

    reason: str
    error: Optional[str] = None
    code: Optional[str] = None


class OutputProcessor:
    """The one owner of what a request has produced and been told: output tokens and their
    per-token values, and the events sent to its callback (`seq.output_ids` and `seq.out`,
    sequence_state.OutputState)."""

    def __init__(self, guided: Any, check_stop_token: Callable[[Sequence], Optional[str]],
                 vocab_size: int, kv: Any):
        self.guided = guided  # advanced by each appended token of a guided request
        self.check_stop_token = check_stop_token  # EOS / stop ids / max_tokens / max_seq_len
        self.vocab_size = vocab_size
        self.kv = kv

    def append(self, seq: Sequence, tokens: list[int]) -> Optional[Finish]:
        """Append accepted tokens up to the first finish condition. Returns how the request ends,
        or None when it goes on."""
        out, stats = seq.out, seq.stats
        if stats.first_token_time is None:
            stats.first_token_time = time.monotonic()
            stats.first_token_time_ns = time.time_ns()
        stats.last_token_time_ns = time.time_ns()
        lps, tops, rows = out.step_logprobs, out.step_top_logprobs, out.step_logits  # aligned with tokens
        out.step_logprobs = out.step_top_logprobs = out.step_logits = None
        reason = None
        new: list[int] = []
        guided = seq.guide.grammar is not None
        if any(t < 0 for t in tokens):  # the runner's mark for non-finite logits in this row
            return Finish("error", "the model produced non-finite logits (NaN/inf) for this request")
        failed = None
        for t in tokens:
            if guided and not self.guided.advance(seq.slot, t):
                failed = self._rejected(seq, t)
                break
            if lps is not None:
                out.logprobs.append(lps[len(new)])
            if tops is not None:
                out.top_logprobs.append(tops[len(new)])
            if rows is not None:
                out.logits_unsent.append(rows[len(new)])
            seq.output_ids.append(t)
            new.append(t)
            reason = self.check_stop_token(seq)
            if guided and self.guided.is_terminated(seq.slot):
                reason = "stop"
            if len(seq.output_ids) >= seq.params.min_tokens and any(
                    seq.output_ids[-len(w):] == w for w in seq.params.stop_token_seqs):
                reason = "stop"  # TRT-LLM stop words: the tokens stay in the output
            if reason:
                break
        if failed is not None:  # NOTE: the tokens before it are output (its final event carries them)
            return failed
        return Finish(reason) if reason else None

    def _rejected(self, seq: Sequence, t: int) -> Finish:
        """How a request ends whose drawn token `t` its grammar rejects: no token was left to draw.
        The guide takes none here (a character no token of this vocabulary writes: the client's
        guide), or bad_words ban every one it takes (the client's bans); else a bug."""
        why = self._violation(seq.slot)
        if why:
            return Finish("error", f"the output violates the JSON schema: {why}", "INTERNAL")
        kind = seq.guide.params.guide_type if seq.guide.params is not None else "grammar"
        n = len(seq.output_ids)
        banned = frozenset(bad_word_bans(seq))
        try:
            if self.guided.viable_now(seq.slot) == -1:
                return Finish("error", f"the {kind} guide allows no token after {n} output tokens: this model's "
                              "vocabulary cannot write what it requires next (e.g. a character no token encodes)",
                              "INVALID_ARG")
            if banned and self.guided.viable_now(seq.slot, banned) == -1:
                return Finish("error", f"bad_words ban every token the {kind} guide allows after {n} output tokens",
                              "INVALID_ARG")
        except Exception:  # noqa: BLE001 - a broken matcher: the plain message will do
            log.exception("checking the guide of request %s after a rejected token", seq.seq_id)
        return Finish("error", f"token {t} violates the {kind} guide (its masked row allowed no token)", "INTERNAL")

    def _violation(self, slot: int) -> Optional[str]:
        """A best-effort guide's value-check verdict for an error message (None when unknown)."""
        try:
            return self.guided.violation(slot)
        except Exception:  # noqa: BLE001 - a broken matcher: the plain message will do
            return None

    def close(self, seq: Sequence, reason: str, error_code: Optional[str]) -> None:
        """The output side of finishing, before the scheduler frees the slot: where the request was
        and its error code."""
        seq.out.stage = "compiling" if seq.guide.compile is not None else STAGES[seq.status]
        seq.out.error_code = error_code or ("INTERNAL" if reason == "error" else None)

    def emit(self, seq: Sequence, finished: bool) -> bool:
        """Send the request's new tokens (and, when `finished`, its final event) to its callback.
        Returns False when the callback raised (the caller cancels the request)."""
        new_ids = seq.output_ids[seq.out.ids_sent:]
        if not finished and not new_ids:
            return True
        out = self._event(seq, new_ids, finished)
        seq.out.ids_sent = len(seq.output_ids)
        try:
            seq.callback(out)
            return True
        except Exception:
            log.exception("callback of request %s raised; cancelling it", seq.seq_id)
            return False

    def _event(self, seq: Sequence, new_ids: list[int], finished: bool) -> RequestOutput:
        p, o, st = seq.params, seq.out, seq.stats
        sent = o.ids_sent
        context = None
        if o.context_logits and sum(len(c) for c in o.context_logits) == len(seq.prompt_ids):
            context = torch.cat(o.context_logits).numpy()  # once, with the first event after prefill
            o.context_logits = []
        prompt_lps = None
        if o.prompt_logprobs is not None and p.prompt_logprobs is not None \
                and len(o.prompt_logprobs) == len(seq.prompt_ids) - 1:
            prompt_lps, o.prompt_logprobs = [(seq.prompt_ids[0], None, [])] + o.prompt_logprobs, None  # once
        gen_logits = None
        if p.return_generation_logits:
            rows, o.logits_unsent = o.logits_unsent, []
            gen_logits = (torch.stack(rows) if rows else torch.empty(0, self.vocab_size)).numpy()
        blocks = self.kv.blocks(seq.num_tokens) if st.first_scheduled_time_ns else 0
        reused = seq.num_reused // self.kv.tokens_per_block  # whole blocks of a reused prompt prefix
        return RequestOutput(
            seq_id=seq.seq_id, token_ids=new_ids, finished=finished,
            finish_reason=seq.finish_reason if finished else None, error=seq.error,
            error_code=o.error_code if finished else None, stage=o.stage if finished else None,
            guide_notes=guide_notes(seq.guide.grammar, seq.output_ids) if finished else (),
            total_draft_tokens=st.num_draft, total_accepted_draft_tokens=st.num_accepted,
            num_input_tokens=len(seq.prompt_ids), num_output_tokens=len(seq.output_ids),
            num_cached_tokens=seq.num_reused,
            first_token=sent == 0 and bool(new_ids),
            logprobs=o.logprobs[sent:] if p.wants_logprobs else None,
            top_logprobs=o.top_logprobs[sent:] if p.top_logprobs else None,
            cum_logprob=sum(o.logprobs) if p.wants_logprobs else None,
            generation_logits=gen_logits, context_logits=context, prompt_logprobs=prompt_lps,
            arrival_time_ns=st.arrival_time_ns, first_scheduled_time_ns=st.first_scheduled_time_ns,
            first_token_time_ns=st.first_token_time_ns, last_token_time_ns=st.last_token_time_ns,
            kv_cache_alloc_new_blocks=blocks - reused, kv_cache_reused_blocks=reused,
            kv_cache_alloc_total_blocks=blocks, kv_cache_hit_rate=reused / blocks if blocks else 0.0)


def guide_notes(guide: Any, output_ids: "list[int] | tuple" = ()) -> tuple[str, ...]:
    """What a JSON guide's grammar does not enforce by itself: keywords left unchecked (best effort)
    and keywords checked with jsonschema when their value closes ("keyword at /pointer"); and
    whether max_tokens closed the document (guided/budget.py)."""
    budget = getattr(guide, "budget", None)
    closed = (f"closed by the budget: max_tokens {budget.budget} left room only for the shortest valid end",) \
        if budget is not None and budget.closed(output_ids) else ()
    return tuple(f"not enforced: {u}" for u in getattr(guide, "unenforced", ())) + tuple(
        f"checked when its value closes: {c}" for c in getattr(guide, "checked", ())) + closed
