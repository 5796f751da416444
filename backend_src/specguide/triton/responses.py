"""Engine events -> response tensors, in the shapes each interface's clients index.

TensorRT-LLM (`specguide`, `specguide_unary`): `text_output` [1], `output_ids` [1, 1, n] (batch,
beam, tokens), `sequence_length` / `batch_index` / `sequence_index` / perf metrics [1, 1],
`cum_log_probs` [1, 1], `output_log_probs` [1, 1, n], `context_logits` [1, prompt, vocab],
`generation_logits` [1, 1, n, vocab]. A stream never repeats the prompt.
vLLM (`specguide_vllm`): every output [1], as the vLLM backend sends them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..request import InvalidRequestError, RequestOutput

VLLM_ERROR_PREFIX = "Error generating stream: "  # the vLLM backend's text for every request error
_PERF_INT32 = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
_PERF_INT64 = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


class UnsupportedError(InvalidRequestError):
    """A well-formed request asking for something this server does not do (UNSUPPORTED)."""

    code = "UNSUPPORTED"


@dataclass
class Payload:
    """What to send for one engine event: output tensors, or an error; and whether the sequence ended."""

    outputs: Optional[dict[str, np.ndarray]] = None
    error: Optional[str] = None
    error_code: str = "INTERNAL"  # a pb.TritonError attribute name
    finished: bool = False


def _col(value: Any, dtype: Any) -> np.ndarray:
    return np.array([[value]], dtype=dtype)  # [1, 1]


class SequenceStream:
    """Turns one sequence's RequestOutput events into response payloads.

    Streaming: one payload per event (the delta), the last one on the finishing event.
    Not streaming: nothing until the finishing event, then one payload with all of it.
    `parsed` is a request_parser.ParsedRequest; `tokenizer` decodes single tokens for vLLM's `logprobs`.
    """

    def __init__(self, parsed: Any, tokenizer: Any = None):
        self.parsed, self.tokenizer = parsed, tokenizer
        self.text: list[str] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[Any] = []
        self.gen_logits: list[np.ndarray] = []
        self.context_logits: Optional[np.ndarray] = None
        self.prompt_lps: Optional[list] = None  # the prompt's log probs until a payload carries them
        self.cum_logprob = 0.0
        self.echo_pending = not parsed.exclude_input

    def on_output(self, out: RequestOutput) -> Optional[Payload]:
        p = self.parsed
        if out.finished and out.finish_reason in ("error", "cancelled"):
            return self._error(out)
        lps = list(out.logprobs or [])
        self.cum_logprob += float(sum(lps))
        if out.context_logits is not None:
            self.context_logits = np.asarray(out.context_logits, dtype=np.float32)
        if out.prompt_logprobs is not None:
            self.prompt_lps = out.prompt_logprobs
        if not p.stream:
            self.text.append(out.text)
            self.ids.extend(out.token_ids)
            self.logprobs.extend(lps)
            self.top.extend(out.top_logprobs or [])
            if out.generation_logits is not None:
                self.gen_logits.append(np.asarray(out.generation_logits, dtype=np.float32))
            if not out.finished:
                return None
            text, ids, n_out = "".join(self.text), list(self.ids), out.num_output_tokens
            lps, top, gen = self.logprobs, self.top, self.gen_logits
        else:
            if not out.finished and not out.text and not out.token_ids:
                return None
            text, ids, n_out = out.text, list(out.token_ids), len(out.token_ids)
            top = list(out.top_logprobs or [])
            gl = out.generation_logits
            gen = [np.asarray(gl, dtype=np.float32)] if gl is not None else []
        gen_ids = list(ids)
        if self.echo_pending:  # only ever for a non-streamed response (parsing refuses or ignores the rest)
            text, ids = p.echo_text + text, list(p.echo_ids) + ids
            self.echo_pending = False
        if p.interface == "vllm":
            outputs = self._vllm(out, text, gen_ids, n_out, lps, top)
        else:
            outputs = self._trtllm(out, text, ids, n_out, lps, gen)
            if p.return_logprobs:  # the generated tokens only, as vLLM's output
                outputs["logprobs"] = np.array([json.dumps(self._vllm_logprobs(gen_ids, lps, top)).encode()],
                                               dtype=np.object_)
        if self.prompt_lps is not None:  # once, on the first payload after the prefill
            doc = [self._vllm_entry(*e) for e in self.prompt_lps]
            outputs["prompt_logprobs"] = np.array([json.dumps(doc).encode()], dtype=np.object_)
            self.prompt_lps = None
        return Payload(outputs=outputs, finished=out.finished)

    # ------------------------------------------------------------------ per interface

    def _trtllm(self, out: RequestOutput, text: str, ids: list[int], n_out: int, lps: list[float],
                gen: list[np.ndarray]) -> dict[str, np.ndarray]:
        p = self.parsed
        outputs = {
            "text_output": np.array([text.encode("utf-8")], dtype=np.object_),
            "output_ids": np.array(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": _col(len(ids), np.int32),
            "finish_reason": _col((out.finish_reason or "").encode() if out.finished else b"", np.object_),
            "batch_index": _col(p.batch_index, np.int32),
            "sequence_index": _col(p.sequence_index, np.int32),
        }
        if p.return_num_input_tokens:
            outputs["num_input_tokens"] = _col(out.num_input_tokens, np.uint32)
            outputs["num_cached_tokens"] = _col(out.num_cached_tokens, np.uint32)
        if p.return_num_output_tokens:
            outputs["num_output_tokens"] = _col(n_out, np.uint32)
        if out.finished and out.guide_notes:
            outputs["guide_notes"] = np.array([n.encode() for n in out.guide_notes], dtype=np.object_)
        if p.return_log_probs:
            outputs["cum_log_probs"] = _col(self.cum_logprob, np.float32)
            outputs["output_log_probs"] = np.array(lps, dtype=np.float32).reshape(1, 1, -1)
        if p.return_context_logits and self.context_logits is not None:
            outputs["context_logits"] = self.context_logits[None]  # [1, prompt, vocab]
            self.context_logits = None  # once: on the first response that can carry it
        if p.return_generation_logits:
            rows = np.concatenate(gen, axis=0) if gen else np.zeros((0, 0), np.float32)
            outputs["generation_logits"] = rows[None, None]  # [1, 1, n, vocab]
        if p.return_perf_metrics:
            drafted = int(out.total_draft_tokens or 0)
            accepted = int(out.total_accepted_draft_tokens or 0)
            for name in _PERF_INT32:
                outputs[name] = _col(int(getattr(out, name, 0) or 0), np.int32)
            for name in _PERF_INT64:
                outputs[name] = _col(int(getattr(out, name, 0) or 0), np.int64)
            outputs["total_draft_tokens"] = _col(drafted, np.int32)
            outputs["total_accepted_draft_tokens"] = _col(accepted, np.int32)
            outputs["acceptance_rate"] = _col(accepted / drafted if drafted else 0.0, np.float32)
        return outputs

    def _vllm(self, out: RequestOutput, text: str, ids: list[int], n_out: int, lps: list[float],
              top: list[Any]) -> dict[str, np.ndarray]:
        p = self.parsed
        outputs = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
        if p.return_finish_reason:  # vLLM: str(None) before the end; its name for a time limit is "abort"
            reason = "None" if not out.finished else ("abort" if out.finish_reason == "timeout" else out.finish_reason)
            outputs["finish_reason"] = np.array([str(reason).encode()], dtype=np.object_)
        if p.return_cumulative_logprob:
            outputs["cumulative_logprob"] = np.array([self.cum_logprob], dtype=np.float32)
        if p.return_logprobs:
            doc = None if p.top_logprobs is None else self._vllm_logprobs(ids, lps, top)
            outputs["logprobs"] = np.array([json.dumps(doc).encode()], dtype=np.object_)
        if p.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([out.num_input_tokens], dtype=np.uint32)
        if p.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([n_out], dtype=np.uint32)
        return outputs

    def _vllm_logprobs(self, ids: list[int], lps: list[float], top: list[Any]) -> list[dict[str, dict]]:
        """vLLM's per-token {token_id: {logprob, rank, decoded_token}}: the sampled token and the top N."""
        assert len(lps) == len(ids), "every emitted token carries its log prob"
        return [self._vllm_entry(tid, lp, list(top[i]) if i < len(top) else []) for i, (tid, lp) in enumerate(zip(ids, lps))]

    def _vllm_entry(self, tid: int, lp: Optional[float], best: list[Any]) -> dict[str, dict]:
        """One token's {token_id: {logprob, rank, decoded_token}}: the token and the top N (a prompt's
        first token: logprob and rank null, as nothing predicts it)."""
        if lp is None:
            return {str(tid): {"logprob": None, "rank": None, "decoded_token": self._decode(tid)}}
        ranked = {int(t): (r + 1, float(v)) for r, (t, v) in enumerate(best)}
        rank = ranked[tid][0] if tid in ranked else len(best) + 1  # NOTE: a lower bound past the top N
        entry = {str(tid): {"logprob": float(lp), "rank": rank, "decoded_token": self._decode(tid)}}
        for t, (r, v) in ranked.items():
            if t != tid:
                entry[str(t)] = {"logprob": v, "rank": r, "decoded_token": self._decode(t)}
        return entry

    def _decode(self, tid: int) -> str:
        return self.tokenizer.decode([tid]) if self.tokenizer is not None else ""

    def _error(self, out: RequestOutput) -> Payload:
        vllm = self.parsed.interface == "vllm"
        if out.finish_reason == "cancelled":
            return Payload(error="Request was cancelled" if vllm else "request was cancelled",
                           error_code="CANCELLED", finished=True)
        message = out.error or "generation failed"
        return Payload(error=VLLM_ERROR_PREFIX + message if vllm else message, error_code=event_error_code(out),
                       finished=True)


def merge_payloads(payloads: list[Payload]) -> Payload:
    """One response for a whole request (the unary interface): the rows' tensors stacked on axis 0,
    shorter trailing axes padded (ids with 0, strings with b""; `sequence_length` says what is real).
    The first error wins."""
    for p in payloads:
        if p.error is not None:
            return Payload(error=p.error, error_code=p.error_code, finished=True)
    if len(payloads) == 1:
        return payloads[0]
    merged = {}
    for name in payloads[0].outputs:
        arrays = [p.outputs[name] for p in payloads]
        shape = tuple(max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim))
        fill = b"" if arrays[0].dtype == np.object_ else 0
        padded = []
        for a in arrays:
            pad = [(0, 0)] + [(0, s - a.shape[d + 1]) for d, s in enumerate(shape)]
            padded.append(np.pad(a, pad, constant_values=fill) if any(w for _, w in pad) else a)
        merged[name] = np.concatenate(padded, axis=0)
    return Payload(outputs=merged, finished=True)


def to_response(pb: Any, payload: Payload) -> Any:
    if payload.error is not None:
        return error_response(pb, payload.error, payload.error_code)
    return pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in payload.outputs.items()])


# codes an engine error event may carry (RequestOutput.error_code); anything else is INTERNAL
_EVENT_ERROR_CODES = ("INVALID_ARG", "UNSUPPORTED", "UNAVAILABLE", "INTERNAL")


def event_error_code(out: RequestOutput) -> str:
    """The pb.TritonError code name for an engine error event (e.g. INVALID_ARG for a bad guide)."""
    code = (out.error_code or "INTERNAL").upper()
    return code if code in _EVENT_ERROR_CODES else "INTERNAL"


def error_response(pb: Any, message: str, code: str = "INTERNAL") -> Any:
    err_cls = pb.TritonError
    return pb.InferenceResponse(output_tensors=[], error=err_cls(message, getattr(err_cls, code, err_cls.INTERNAL)))


def safe_send(pb: Any, sender: Any, response: Any, flags: int, who: str = "specguide") -> None:
    """Send one response (None: only the flags); a client that is gone or a closed sender is logged."""
    try:
        if response is None:
            sender.send(flags=flags)
        else:
            sender.send(response, flags=flags)
    except Exception as e:  # nothing else to do
        pb.Logger.log_warn(f"{who}: could not send a response: {e}")
