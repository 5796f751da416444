"""Triton tensors <-> engine messages. The only place that knows tensor names and dtypes.

Inputs follow the TensorRT-LLM ensemble (`text_input`, `max_tokens`, `temperature`, ...) and the
vLLM backend's `sampling_parameters` JSON string. The guide (`guided_decoding_guide_type` /
`guided_decoding_guide`, or vLLM's `structured_outputs` / `guided_decoding`) is read and checked by
`specguide.guided.params`, the one mapping of guides. Every function here is pure: the Triton module
(`triton_python_backend_utils`) is passed in as `pb` where a Triton object must be built, so the
unit tests run with a tiny fake of it.

Row b of a request with batch size B becomes one `ParsedRequest` (one engine sequence); its
responses carry `batch_index = b`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .. import faults
from ..guided.params import GUIDE_TYPES, resolve_guided
from ..request import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    Request,
    RequestOutput,
    SamplingParams,
)


class UnsupportedError(InvalidRequestError):
    """A well-formed request asking for something this server does not do (UNSUPPORTED)."""


# --------------------------------------------------------------------------------------------
# The interface: every input and output, its Triton dtype, dims (without the batch dimension)
# and default. config.pbtxt and the README table are checked against these by the tests.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    name: str
    dtype: str  # Triton data type, e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    default: str  # documented default ("" for outputs)
    doc: str


INPUTS: tuple[Spec, ...] = (
    Spec("text_input", "TYPE_STRING", (1,), "-", "prompt text (give this or `input_ids`)"),
    Spec("input_ids", "TYPE_INT32", (-1,), "-", "prompt token ids (give this or `text_input`)"),
    Spec("input_lengths", "TYPE_INT32", (1,), "row length", "valid length of a padded `input_ids` row"),
    Spec("max_tokens", "TYPE_INT32", (1,), "`default_max_tokens` (64)", "tokens to generate at most"),
    Spec("min_tokens", "TYPE_INT32", (1,), "0", "EOS and stop tokens are suppressed before this many"),
    Spec("min_length", "TYPE_INT32", (1,), "0", "alias of `min_tokens` (sent by genai-perf)"),
    Spec("stream", "TYPE_BOOL", (1,), "false", "one response per step (deltas) instead of one at the end"),
    Spec("exclude_input_in_output", "TYPE_BOOL", (1,), "true if streaming, else false",
         "leave the prompt out of `text_output` / `output_ids`"),
    Spec("temperature", "TYPE_FP32", (1,), "0 (greedy) if no temperature/top_k/top_p, else 1.0", "sampling temperature"),
    Spec("top_k", "TYPE_INT32", (1,), "0 (off)", "sample from the k most likely tokens"),
    Spec("top_p", "TYPE_FP32", (1,), "1.0 (off)", "nucleus sampling mass, in (0, 1]"),
    Spec("seed", "TYPE_UINT64", (1,), "random", "sampling seed"),
    Spec("random_seed", "TYPE_UINT64", (1,), "random", "alias of `seed` (TensorRT-LLM name)"),
    Spec("stop_words", "TYPE_STRING", (-1,), "none", "strings that end generation (cut from the text); empty strings ignored"),
    Spec("bad_words", "TYPE_STRING", (-1,), "none", "strings whose token sequences are never generated"),
    Spec("end_id", "TYPE_INT32", (1,), "the tokenizer's EOS", "token id that ends generation"),
    Spec("pad_id", "TYPE_INT32", (1,), "-", "accepted and ignored"),
    Spec("num_draft_tokens", "TYPE_INT32", (1,), "the configured K", "draft tokens per step; 0 turns speculation off"),
    Spec("guided_decoding_guide_type", "TYPE_STRING", (1,), "none",
         "one of " + ", ".join(f"`{g}`" for g in GUIDE_TYPES)),
    Spec("guided_decoding_guide", "TYPE_STRING", (1,), "\"\"", "the schema / regex / grammar / tag / JSON list of choices"),
    Spec("sampling_parameters", "TYPE_STRING", (1,), "none",
         "vLLM backend JSON (max_tokens 16, temperature 1.0 when given); individual tensors override it"),
    Spec("return_num_input_tokens", "TYPE_BOOL", (1,), "false", "add `num_input_tokens` to responses"),
    Spec("return_num_output_tokens", "TYPE_BOOL", (1,), "false", "add `num_output_tokens` to responses"),
    Spec("return_perf_metrics", "TYPE_BOOL", (1,), "false", "add the draft-token counters to responses"),
    Spec("beam_width", "TYPE_INT32", (1,), "1", "only 1 is supported"),
    Spec("frequency_penalty", "TYPE_FP32", (1,), "0 (off)",
         "in [-2, 2]; subtracted from a token's logit once per occurrence in the output (OpenAI/vLLM)"),
    Spec("presence_penalty", "TYPE_FP32", (1,), "0 (off)",
         "in [-2, 2]; subtracted once from the logits of tokens already in the output (OpenAI/vLLM)"),
    Spec("repetition_penalty", "TYPE_FP32", (1,), "1.0 (off)",
         "> 0; divides positive / multiplies negative logits of tokens in the prompt or output (HF/TRT-LLM)"),
    Spec("length_penalty", "TYPE_FP32", (1,), "1", "accepted and ignored (beam search only)"),
    Spec("timeout_s", "TYPE_FP32", (1,), "`request_timeout_s` (0 = none)",
         "time limit from arrival (queue + generation); past it the request ends with `finish_reason` `timeout`"),
)

OUTPUTS: tuple[Spec, ...] = (
    Spec("text_output", "TYPE_STRING", (-1,), "", "one string per response: the new text when streaming, else all of it"),
    Spec("output_ids", "TYPE_INT32", (-1,), "", "the token ids matching `text_output`"),
    Spec("finish_reason", "TYPE_STRING", (1,), "", "`stop`, `length` or `timeout` on a sequence's last response, \"\" before"),
    Spec("batch_index", "TYPE_INT32", (1,), "", "the request row this response belongs to"),
    Spec("num_input_tokens", "TYPE_UINT32", (1,), "", "prompt tokens (with `return_num_input_tokens`)"),
    Spec("num_output_tokens", "TYPE_UINT32", (1,), "", "generated tokens in this response (with `return_num_output_tokens`)"),
    Spec("total_draft_tokens", "TYPE_INT32", (1,), "", "draft tokens proposed so far (with `return_perf_metrics`)"),
    Spec("total_accepted_draft_tokens", "TYPE_INT32", (1,), "", "draft tokens accepted so far (with `return_perf_metrics`)"),
    Spec("acceptance_rate", "TYPE_FP32", (1,), "", "accepted / proposed draft tokens (with `return_perf_metrics`)"),
)

INPUT_NAMES = tuple(s.name for s in INPUTS)
GUIDED_DISABLED_MESSAGE = "guided decoding is not enabled yet"
VLLM_DEFAULT_MAX_TOKENS = 16
FAULT_PARAMETER = "specguide_fault"  # request parameter naming an injected fault (specguide.faults)


@dataclass
class ParsedRequest:
    """One engine sequence plus how its responses are to be shaped."""

    request: Request
    stream: bool = False
    exclude_input: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    batch_index: int = 0
    echo_text: str = ""  # prepended to the first response when the prompt is echoed
    echo_ids: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Reading a Triton request
# --------------------------------------------------------------------------------------------


def read_tensors(pb: Any, request: Any) -> dict[str, np.ndarray]:
    """Every known input present in `request`, as numpy arrays of shape [B, ...]."""
    tensors = {}
    for name in INPUT_NAMES:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            tensors[name] = t.as_numpy()
    return tensors


def read_parameters(request: Any) -> dict[str, Any]:
    """The request's parameters (gRPC parameters, unmatched HTTP generate keys) as a dict."""
    try:
        raw = request.parameters()
    except Exception:  # older stubs
        return {}
    if not raw:
        return {}
    try:
        params = json.loads(raw) if isinstance(raw, (str, bytes)) else dict(raw)
    except ValueError:
        return {}
    return params if isinstance(params, dict) else {}


def parse_request(
    tensors: dict[str, np.ndarray],
    parameters: Optional[dict[str, Any]] = None,
    *,
    default_max_tokens: int = 64,
    max_tokens_limit: int = 2048,
    tokenizer: Any = None,
    guided_enabled: bool = False,
    request_id: str = "",
) -> list[ParsedRequest]:
    """Map one Triton request (all its rows) to engine requests; raise InvalidRequestError on bad input.

    Nothing is submitted here, so a bad row rejects the whole request before anything runs.
    """
    parameters = parameters or {}
    batch = _batch_size(tensors)
    return [
        _parse_row(tensors, parameters, b, default_max_tokens, max_tokens_limit, tokenizer, guided_enabled, request_id)
        for b in range(batch)
    ]


def _batch_size(tensors: dict[str, np.ndarray]) -> int:
    has_text, has_ids = "text_input" in tensors, "input_ids" in tensors
    if has_text and has_ids:
        raise InvalidRequestError("give either text_input or input_ids, not both")
    if not (has_text or has_ids):
        raise InvalidRequestError("missing prompt: give text_input (or input_ids)")
    prompt = tensors["text_input" if has_text else "input_ids"]
    if prompt.ndim == 0 or prompt.shape[0] == 0:
        raise InvalidRequestError("the prompt tensor is empty")
    return int(prompt.shape[0])


class _Row:
    """Typed access to row b of every tensor, falling back to request parameters for scalars."""

    def __init__(self, tensors: dict[str, np.ndarray], parameters: dict[str, Any], b: int):
        self.tensors, self.parameters, self.b = tensors, parameters, b

    def values(self, name: str) -> Optional[np.ndarray]:
        arr = self.tensors.get(name)
        if arr is None:
            return None
        row = arr[self.b] if arr.ndim >= 1 and arr.shape[0] > self.b else arr
        return np.asarray(row).reshape(-1)

    def scalar(self, name: str) -> Any:
        vals = self.values(name)
        if vals is None:
            return self.parameters.get(name)
        if vals.size == 0:
            return None
        if vals.size != 1:
            raise InvalidRequestError(f"{name} must hold one value per row, got {vals.size}")
        return vals[0].item() if hasattr(vals[0], "item") else vals[0]

    def int(self, name: str) -> Optional[int]:
        return _as_int(self.scalar(name), name)

    def float(self, name: str) -> Optional[float]:
        return _as_float(self.scalar(name), name)

    def bool(self, name: str) -> Optional[bool]:
        return _as_bool(self.scalar(name), name)

    def str(self, name: str) -> Optional[str]:
        v = self.scalar(name)
        return None if v is None else _as_str(v, name)

    def strs(self, name: str) -> list[str]:
        vals = self.values(name)
        if vals is None:
            return []
        return [s for s in (_as_str(v, name) for v in vals) if s]


def _parse_row(tensors, parameters, b, default_max_tokens, max_tokens_limit, tokenizer, guided_enabled, request_id):
    row = _Row(tensors, parameters, b)
    req = Request(request_id=request_id)

    # prompt
    if "text_input" in tensors:
        req.prompt = row.str("text_input")
        if not req.prompt:
            raise InvalidRequestError("text_input is empty")
    else:
        ids = row.values("input_ids")
        length = row.int("input_lengths")
        if length is not None:
            if not 0 < length <= ids.size:
                raise InvalidRequestError(f"input_lengths {length} is outside [1, {ids.size}]")
            ids = ids[:length]
        if ids.size == 0:
            raise InvalidRequestError("input_ids is empty")
        req.prompt_ids = [int(i) for i in ids]
        if min(req.prompt_ids) < 0:
            raise InvalidRequestError("input_ids must be >= 0")

    # sampling: vLLM JSON first (with vLLM's defaults), then the individual tensors override it
    sp_json = row.str("sampling_parameters")
    if sp_json:
        vllm = _parse_vllm_json(sp_json)
        sp = _from_vllm(vllm, tokenizer)
    else:
        vllm, sp = None, SamplingParams(max_tokens=default_max_tokens, temperature=0.0)
    _apply_tensor_sampling(row, sp, explicit_sampling=bool(sp_json), tokenizer=tokenizer)
    sp.validate(max_tokens_limit)
    req.params = sp

    # guided decoding: the TensorRT-LLM tensors or the vLLM JSON (one guide; guided.params checks it)
    req.guided = resolve_guided(row.str("guided_decoding_guide_type"), row.str("guided_decoding_guide"), vllm)
    if req.guided is not None and not guided_enabled:
        raise UnsupportedError(GUIDED_DISABLED_MESSAGE)

    # speculation
    k = row.int("num_draft_tokens")
    if k is not None and k < 0:
        raise InvalidRequestError(f"num_draft_tokens must be >= 0, got {k}")
    req.num_draft_tokens = k

    # time limit; an injected fault (tests; only with SPECGUIDE_FAULT_INJECTION=1)
    timeout = row.float("timeout_s")
    if timeout is not None and not (0.0 <= timeout < math.inf):
        raise InvalidRequestError(f"timeout_s must be a finite number >= 0 (0 = none), got {timeout}")
    req.timeout_s = timeout
    if faults.enabled():
        fault = parameters.get(FAULT_PARAMETER)
        faults.parse(fault)  # a bad fault name is INVALID_ARG here
        req.fault = fault

    # response shape
    stream = bool(row.bool("stream"))
    exclude = row.bool("exclude_input_in_output")
    parsed = ParsedRequest(
        request=req,
        stream=stream,
        exclude_input=stream if exclude is None else exclude,
        return_num_input_tokens=bool(row.bool("return_num_input_tokens")),
        return_num_output_tokens=bool(row.bool("return_num_output_tokens")),
        return_perf_metrics=bool(row.bool("return_perf_metrics")),
        batch_index=b,
    )
    if not parsed.exclude_input:
        parsed.echo_text, parsed.echo_ids = _echo(req, tokenizer)
    return parsed


def _apply_tensor_sampling(row: _Row, sp: SamplingParams, explicit_sampling: bool, tokenizer: Any) -> None:
    """TensorRT-LLM tensors. Greedy unless temperature, top_k or top_p is given (TRT-LLM's rule)."""
    temperature, top_k, top_p = row.float("temperature"), row.int("top_k"), row.float("top_p")
    if not explicit_sampling and (temperature is not None or top_k is not None or top_p is not None):
        sp.temperature = 1.0
    if temperature is not None:
        sp.temperature = temperature
    if top_k is not None:
        sp.top_k = top_k
    if top_p is not None:
        sp.top_p = top_p
    max_tokens = row.int("max_tokens")
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    min_tokens = row.int("min_tokens")
    if min_tokens is None:
        min_tokens = row.int("min_length")
    if min_tokens is not None:
        sp.min_tokens = min_tokens
    seed = row.int("seed")
    if seed is None:
        seed = row.int("random_seed")
    if seed is not None:
        sp.seed = seed
    end_id = row.int("end_id")
    if end_id is not None:
        sp.end_id = end_id
    stop = row.strs("stop_words")
    if stop:
        sp.stop = list(sp.stop) + stop
    bad = row.strs("bad_words")
    if bad:
        sp.bad_words_ids = list(sp.bad_words_ids) + _encode_words(bad, tokenizer)
    for key in _PENALTIES:  # checked by SamplingParams.validate; they do not turn sampling on
        v = row.float(key)
        if v is not None:
            setattr(sp, key, v)
    _check_neutral("beam_width", row.int("beam_width"), 1)


# Sampling penalties: the TensorRT-LLM tensors and the vLLM keys have the same names.
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")

# vLLM SamplingParams fields we accept only at their neutral value, and fields we ignore.
_VLLM_NEUTRAL = {
    "n": 1, "best_of": 1, "logprobs": 0, "prompt_logprobs": 0, "use_beam_search": False, "length_penalty": 1.0,
    "min_p": 0.0,
}
_VLLM_INTS = ("max_tokens", "min_tokens", "top_k", "seed")
_VLLM_FLOATS = ("temperature", "top_p") + _PENALTIES


def _parse_vllm_json(text: str) -> dict[str, Any]:
    try:
        d = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise InvalidRequestError("sampling_parameters must be a JSON object")
    return d


def _from_vllm(d: dict[str, Any], tokenizer: Any) -> SamplingParams:
    """The vLLM backend's `sampling_parameters`, with vLLM's defaults (max_tokens 16, temperature 1.0).

    Values may be strings ("max_tokens": "16"), as genai-perf sends them. Unknown keys are ignored.
    The guide (`structured_outputs` / `guided_decoding`) is read by guided.params.resolve_guided.
    """
    sp = SamplingParams(max_tokens=VLLM_DEFAULT_MAX_TOKENS, temperature=1.0)
    for key in _VLLM_INTS:
        if d.get(key) is not None:
            setattr(sp, key, _as_int(d[key], key))
    for key in _VLLM_FLOATS:
        if d.get(key) is not None:
            setattr(sp, key, _as_float(d[key], key))
    if sp.top_k == -1:  # vLLM's "off"
        sp.top_k = 0
    if d.get("max_tokens") is None and d.get("max_completion_tokens") is not None:
        sp.max_tokens = _as_int(d["max_completion_tokens"], "max_completion_tokens")
    stop = d.get("stop")
    if stop:
        sp.stop = [stop] if isinstance(stop, str) else [_as_str(s, "stop") for s in stop if s]
    if d.get("stop_token_ids"):
        sp.stop_token_ids = [_as_int(t, "stop_token_ids") for t in _as_list(d["stop_token_ids"], "stop_token_ids")]
    if d.get("ignore_eos") is not None:
        sp.ignore_eos = bool(_as_bool(d["ignore_eos"], "ignore_eos"))
    if d.get("bad_words"):
        sp.bad_words_ids = _encode_words([_as_str(w, "bad_words") for w in _as_list(d["bad_words"], "bad_words")], tokenizer)
    for key, neutral in _VLLM_NEUTRAL.items():
        v = d.get(key)
        if v is not None:
            _check_neutral(key, _as_bool(v, key) if isinstance(neutral, bool) else _as_float(v, key), neutral)
    return sp


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


@dataclass
class Payload:
    """What to send for one engine event: output tensors, or an error; and whether the sequence ended."""

    outputs: Optional[dict[str, np.ndarray]] = None
    error: Optional[str] = None
    error_code: str = "INTERNAL"  # a pb.TritonError attribute name
    finished: bool = False


class SequenceStream:
    """Turns one sequence's RequestOutput events into response payloads.

    Streaming: one payload per event (the delta), the last one on the finishing event.
    Not streaming: nothing until the finishing event, then one payload with all the text.
    """

    def __init__(self, parsed: ParsedRequest):
        self.parsed = parsed
        self.text: list[str] = []
        self.ids: list[int] = []
        self.echo_pending = not parsed.exclude_input

    def on_output(self, out: RequestOutput) -> Optional[Payload]:
        p = self.parsed
        if out.finished and out.finish_reason == "error":
            return Payload(error=out.error or "generation failed", error_code=event_error_code(out), finished=True)
        if out.finished and out.finish_reason == "cancelled":
            return Payload(error="request was cancelled", error_code="CANCELLED", finished=True)
        if not p.stream:
            self.text.append(out.text)
            self.ids.extend(out.token_ids)
            if not out.finished:
                return None
            text, ids, n_out = "".join(self.text), self.ids, out.num_output_tokens
        else:
            if not out.finished and not out.text and not out.token_ids:
                return None
            text, ids, n_out = out.text, list(out.token_ids), len(out.token_ids)
        if self.echo_pending:
            text, ids = p.echo_text + text, list(p.echo_ids) + list(ids)
            self.echo_pending = False
        outputs = {
            "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
            "output_ids": np.array([ids], dtype=np.int32).reshape(1, -1),
            "finish_reason": np.array([[(out.finish_reason or "").encode() if out.finished else b""]], dtype=np.object_),
            "batch_index": np.array([[p.batch_index]], dtype=np.int32),
        }
        if p.return_num_input_tokens:
            outputs["num_input_tokens"] = np.array([[out.num_input_tokens]], dtype=np.uint32)
        if p.return_num_output_tokens:
            outputs["num_output_tokens"] = np.array([[n_out]], dtype=np.uint32)
        if p.return_perf_metrics:
            drafted = int(getattr(out, "total_draft_tokens", 0) or 0)
            accepted = int(getattr(out, "total_accepted_draft_tokens", 0) or 0)
            outputs["total_draft_tokens"] = np.array([[drafted]], dtype=np.int32)
            outputs["total_accepted_draft_tokens"] = np.array([[accepted]], dtype=np.int32)
            outputs["acceptance_rate"] = np.array([[accepted / drafted if drafted else 0.0]], dtype=np.float32)
        return Payload(outputs=outputs, finished=out.finished)


def to_response(pb: Any, payload: Payload) -> Any:
    if payload.error is not None:
        return error_response(pb, payload.error, payload.error_code)
    return pb.InferenceResponse(output_tensors=[pb.Tensor(k, v) for k, v in payload.outputs.items()])


def error_code(exc: BaseException) -> str:
    """The pb.TritonError code name for an exception raised while mapping or submitting."""
    if isinstance(exc, UnsupportedError):
        return "UNSUPPORTED"
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return "INVALID_ARG"
    if isinstance(exc, (QueueFullError, EngineDeadError)):
        return "UNAVAILABLE"
    return "INTERNAL"


# codes an engine error event may carry (RequestOutput.error_code); anything else is INTERNAL
_EVENT_ERROR_CODES = ("INVALID_ARG", "UNSUPPORTED", "UNAVAILABLE", "INTERNAL")


def event_error_code(out: RequestOutput) -> str:
    """The pb.TritonError code name for an engine error event (e.g. INVALID_ARG for a bad guide)."""
    code = (getattr(out, "error_code", None) or "INTERNAL").upper()
    return code if code in _EVENT_ERROR_CODES else "INTERNAL"


def error_response(pb: Any, message: str, code: str = "INTERNAL") -> Any:
    err_cls = pb.TritonError
    return pb.InferenceResponse(output_tensors=[], error=err_cls(message, getattr(err_cls, code, err_cls.INTERNAL)))


# --------------------------------------------------------------------------------------------
# Small converters
# --------------------------------------------------------------------------------------------


def _echo(req: Request, tokenizer: Any) -> tuple[str, list[int]]:
    if req.prompt is not None:
        ids = list(tokenizer.encode(req.prompt)) if tokenizer is not None else []
        return req.prompt, ids
    text = tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""
    return text, list(req.prompt_ids)


def _encode_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer")
    return [list(tokenizer.encode(w)) for w in words if w]


def _check_neutral(name: str, value: Any, neutral: Any) -> None:
    if value is not None and value != neutral:
        raise UnsupportedError(f"{name}={value} is not supported (only {neutral})")


def _as_str(v: Any, name: str) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise InvalidRequestError(f"{name} must be a string, got {type(v).__name__}")


def _as_int(v: Any, name: str) -> Optional[int]:
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        raise InvalidRequestError(f"{name} must be an integer, got {v!r}")
    if isinstance(v, (bytes, str)):
        s = _as_str(v, name).strip()
        try:
            return int(s)
        except ValueError:
            try:
                f = float(s)
            except ValueError:
                raise InvalidRequestError(f"{name} must be an integer, got {s!r}") from None
            v = f
    if isinstance(v, (float, np.floating)):
        if not math.isfinite(v) or v != int(v):
            raise InvalidRequestError(f"{name} must be an integer, got {v!r}")
        return int(v)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be an integer, got {v!r}") from None


def _as_float(v: Any, name: str) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}")
    try:
        f = float(_as_str(v, name) if isinstance(v, bytes) else v)
    except (TypeError, ValueError):
        raise InvalidRequestError(f"{name} must be a number, got {v!r}") from None
    if math.isnan(f):
        raise InvalidRequestError(f"{name} must be a number, got NaN")
    return f


def _as_bool(v: Any, name: str) -> Optional[bool]:
    if v is None:
        return None
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (bytes, str)):
        s = _as_str(v, name).strip().lower()
        if s in ("true", "1", "yes"):
            return True
        if s in ("false", "0", "no", ""):
            return False
        raise InvalidRequestError(f"{name} must be a boolean, got {s!r}")
    if isinstance(v, (int, np.integer)) and v in (0, 1):
        return bool(v)
    raise InvalidRequestError(f"{name} must be a boolean, got {v!r}")


def _as_list(v: Any, name: str) -> list:
    if isinstance(v, (list, tuple)):
        return list(v)
    raise InvalidRequestError(f"{name} must be a list")

