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

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .. import faults
from ..guided.limits import check_guide_text, check_json_text
from ..guided.params import resolve_guided
from ..request import InvalidRequestError, Request, SamplingParams
from .interfaces import ALIASES, INTERFACE_PARAMETER, TRTLLM_INPUT_NAMES, TRTLLM_INPUTS, TRTLLM_OUTPUTS, \
    VLLM_INPUT_NAMES, Spec
from .limits import InputLimits, check_inputs
from .responses import (  # noqa: F401  (re-exported: the adapter and the tests use io.*)
    VLLM_ERROR_PREFIX, Payload, SequenceStream, UnsupportedError, error_code, error_response, event_error_code, merge_payloads,
    to_response,
)


INPUTS: tuple[Spec, ...] = TRTLLM_INPUTS  # the `specguide` model's inputs (the union of the interfaces)
OUTPUTS: tuple[Spec, ...] = TRTLLM_OUTPUTS
INPUT_NAMES = tuple(s.name for s in INPUTS)
GUIDED_DISABLED_MESSAGE = "guided decoding is not enabled yet"
VLLM_DEFAULT_MAX_TOKENS = 16
VLLM_MAX_LOGPROBS = 20
FAULT_PARAMETER = "specguide_fault"  # request parameter naming an injected fault (specguide.faults)
CLIENT_PARAMETERS = "specguide_client_parameters"  # a proxy's client's parameters, as a JSON string
# request parameters every interface accepts: internal ones, and the `Streaming` flag that
# TensorRT-LLM's inflight_batcher_llm_client sends beside its tensors (ignored there as here)
_KNOWN_PARAMETERS = frozenset({FAULT_PARAMETER, INTERFACE_PARAMETER, CLIENT_PARAMETERS, "Streaming"})


@dataclass
class ParsedRequest:
    """One engine sequence plus how its responses are to be shaped."""

    request: Request
    interface: str = "trtllm"  # trtllm | unary | vllm (interfaces.Interface.kind, "engine" -> "trtllm")
    stream: bool = False
    exclude_input: bool = True
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_perf_metrics: bool = False
    return_log_probs: bool = False  # TensorRT-LLM: cum_log_probs + output_log_probs
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_finish_reason: bool = True  # vLLM sends finish_reason only when asked
    return_cumulative_logprob: bool = False
    return_logprobs: bool = False
    top_logprobs: Optional[int] = None  # vLLM `logprobs: N`; None = the `logprobs` output is null
    batch_index: int = 0
    sequence_index: int = 0
    echo_text: str = ""  # prepended to the (one, non-streamed) response when the prompt is echoed
    echo_ids: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Reading a Triton request
# --------------------------------------------------------------------------------------------


def read_tensors(pb: Any, request: Any) -> dict[str, np.ndarray]:
    """Every declared input present in `request`, as numpy arrays of shape [B, ...]."""
    tensors = {}
    for name in INPUT_NAMES:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            tensors[name] = t.as_numpy()
    return tensors


def read_parameters(request: Any, limits: Optional[InputLimits] = None) -> dict[str, Any]:
    """The request's parameters (gRPC parameters, unmatched HTTP generate keys) as a dict.

    With `limits`, oversized or too deeply nested parameters are an InvalidRequestError."""
    try:
        raw = request.parameters()
    except Exception:  # older stubs
        return {}
    if not raw:
        return {}
    if limits is not None and isinstance(raw, (str, bytes)):
        check_inputs({}, raw, limits)
    try:
        if isinstance(raw, (str, bytes)):
            depth = limits.max_json_depth if limits is not None else DEFAULT_JSON_DEPTH
            params = check_json_text(raw if isinstance(raw, str) else raw.decode("utf-8", "replace"),
                                     "the request parameters", depth, "guided_max_nesting_depth")
        else:
            params = dict(raw)
    except InvalidRequestError:
        if limits is not None:
            raise
        return {}
    return params if isinstance(params, dict) else {}


def interface_of(parameters: dict[str, Any]) -> str:
    """Which front end a request came through: `trtllm` (direct), `unary` or `vllm` (BLS proxies)."""
    kind = str(parameters.get(INTERFACE_PARAMETER) or "trtllm")
    if kind not in ("trtllm", "unary", "vllm"):
        raise InvalidRequestError(f"unknown {INTERFACE_PARAMETER} {kind!r}")
    return kind


def is_stop_request(tensors: dict[str, np.ndarray]) -> bool:
    """TensorRT-LLM's stop signal: `stop` true stops the running request with the same request id."""
    stop = tensors.get("stop")
    return stop is not None and bool(np.asarray(stop).reshape(-1).any())


def parse_request(
    tensors: dict[str, np.ndarray],
    parameters: Optional[dict[str, Any]] = None,
    *,
    default_max_tokens: int = 64,
    max_tokens_limit: int = 2048,
    tokenizer: Any = None,
    guided_enabled: bool = False,
    request_id: str = "",
    limits: Optional[InputLimits] = None,
) -> list[ParsedRequest]:
    """Map one Triton request (all its rows, all their return sequences) to engine requests.

    Raises InvalidRequestError on bad input. Nothing is submitted here, so a bad row rejects the
    whole request before anything runs. `limits` (default: InputLimits()) caps input sizes before
    anything is decoded or tokenized; a text prompt is tokenized here once (the engine and the
    echo reuse the ids).
    """
    limits = limits or InputLimits()
    check_inputs(tensors, None, limits)
    parameters = dict(parameters or {})
    interface = interface_of(parameters)
    client = parameters.pop(CLIENT_PARAMETERS, None)  # a proxy passes its client's parameters as JSON
    if client:
        parameters.update(_parse_json_object(client, "request parameters", limits.max_json_depth))
    tensors = _check_names(tensors, parameters, interface)
    ctx = _Context(interface, default_max_tokens, max_tokens_limit, tokenizer, guided_enabled, request_id, limits)
    rows = []
    for b in range(_batch_size(tensors)):
        rows.extend(_parse_row(_Row(tensors, parameters, b), ctx))
    return rows


@dataclass
class _Context:
    interface: str
    default_max_tokens: int
    max_tokens_limit: int
    tokenizer: Any
    guided_enabled: bool
    request_id: str
    limits: InputLimits = field(default_factory=InputLimits)


def _check_names(tensors: dict[str, np.ndarray], parameters: dict[str, Any], interface: str) -> dict[str, np.ndarray]:
    """Refuse what this interface does not know (naming it); fold the TensorRT-LLM spellings into one."""
    known = VLLM_INPUT_NAMES if interface == "vllm" else TRTLLM_INPUT_NAMES
    for name in tensors:
        if name not in known:
            other = "specguide_vllm (the vLLM interface)" if interface != "vllm" else "specguide (TensorRT-LLM)"
            raise InvalidRequestError(f"input '{name}' is not part of this model's interface; it belongs to {other}")
    if interface == "vllm":
        for name in ("image", "embedding_request"):
            if name in tensors:
                raise UnsupportedError(f"input '{name}' is not supported: this model generates text from text")
        bad = [k for k in parameters if k not in _KNOWN_PARAMETERS and k not in VLLM_SAMPLING_KEYS]
        if bad:
            raise InvalidRequestError(f"unknown request parameter '{bad[0]}' (not a vLLM sampling parameter)")
        return tensors
    out = dict(tensors)
    for alias, canonical in ALIASES.items():
        if alias in out:
            if canonical in out:
                raise InvalidRequestError(f"give either {canonical} or {alias} (the same setting), not both")
            out[canonical] = out.pop(alias)
    bad = [k for k in parameters if k not in _KNOWN_PARAMETERS and k not in TRTLLM_INPUT_NAMES]
    if bad:
        raise InvalidRequestError(f"unknown request parameter '{bad[0]}': not an input of this model")
    for alias, canonical in ALIASES.items():  # a parameter spelled the other way is the same setting
        if alias in parameters:
            parameters.setdefault(canonical, parameters.pop(alias))
    return out


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

    def word_lists(self, name: str) -> list[list[int]]:
        """TensorRT-LLM's `[2, L]` word lists: flat token ids, then end offsets (-1 padded)."""
        arr = self.tensors.get(name)
        if arr is None:
            return []
        rows = np.asarray(arr[self.b] if arr.ndim == 3 else arr)
        if rows.ndim != 2 or rows.shape[0] != 2:
            raise InvalidRequestError(f"{name} must be [2, L] per row (token ids; end offsets), got {list(rows.shape)}")
        ids, offsets = rows[0].tolist(), [int(o) for o in rows[1] if o >= 0]
        words, start = [], 0
        for end in offsets:
            if not start < end <= len(ids) or min(ids[start:end]) < 0:
                raise InvalidRequestError(f"{name}: offset {end} does not end a word of token ids")
            words.append([int(i) for i in ids[start:end]])
            start = end
        return words


def _parse_row(row: _Row, ctx: _Context) -> list[ParsedRequest]:
    vllm = ctx.interface == "vllm"
    base = Request(request_id=ctx.request_id)
    _parse_prompt(row, base)

    # sampling: vLLM JSON first (with vLLM's defaults), then the individual tensors override it
    sp_json = row.str("sampling_parameters")
    if vllm and not sp_json:  # the vLLM backend reads the request parameters instead of the tensor
        sp_json = json.dumps({k: v for k, v in row.parameters.items() if k in VLLM_SAMPLING_KEYS})
    if sp_json:
        vllm_params = _parse_json_object(sp_json, "sampling_parameters", ctx.limits.max_json_depth)
        sp = _from_vllm(vllm_params, ctx.tokenizer)
    else:
        vllm_params, sp = None, SamplingParams(max_tokens=ctx.default_max_tokens, temperature=0.0)
    if not vllm:
        _apply_tensor_sampling(row, sp, explicit_sampling=bool(sp_json), tokenizer=ctx.tokenizer)
    sp.validate(ctx.max_tokens_limit)
    base.params = sp

    # guided decoding: the TensorRT-LLM tensors or the vLLM JSON (one guide; guided.params checks it)
    gtype, guide = row.str("guided_decoding_guide_type"), row.str("guided_decoding_guide")
    check_guide_text(gtype, guide, ctx.limits.guide)  # bytes and nesting, before anything parses it
    base.guided = resolve_guided(gtype, guide, vllm_params)
    if base.guided is not None and not ctx.guided_enabled:
        raise UnsupportedError(GUIDED_DISABLED_MESSAGE)

    k = row.int("num_draft_tokens")
    if k is not None and k < 0:
        raise InvalidRequestError(f"num_draft_tokens must be >= 0, got {k}")
    base.num_draft_tokens = k
    timeout = row.float("timeout_s")
    if timeout is not None and not (0.0 <= timeout < math.inf):
        raise InvalidRequestError(f"timeout_s must be a finite number >= 0 (0 = none), got {timeout}")
    base.timeout_s = timeout
    if faults.enabled():  # an injected fault (tests; only with SPECGUIDE_FAULT_INJECTION=1)
        fault = row.parameters.get(FAULT_PARAMETER)
        faults.parse(fault)  # a bad fault name is INVALID_ARG here
        base.fault = fault

    shape = _response_shape(row, ctx, vllm_params)
    n = row.int("num_return_sequences")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_RETURN_SEQUENCES:
        raise InvalidRequestError(f"num_return_sequences must be in [1, {MAX_RETURN_SEQUENCES}], got {n}")
    if base.prompt is not None and ctx.tokenizer is not None:  # tokenized once: the engine and the echo reuse it
        base.prompt_ids = list(ctx.tokenizer.encode(base.prompt))
        if not base.prompt_ids:
            raise InvalidRequestError("text_input is empty after tokenization")
    out = []
    for i in range(n):
        req = copy.deepcopy(base) if i else base
        if i and req.params.seed is not None:  # each return sequence its own stream of randomness
            req.params.seed = (req.params.seed + i) % 2**64
        out.append(dataclasses.replace(shape, request=req, sequence_index=i))
    for p in out:
        sp = p.request.params
        sp.return_log_probs = shape.return_log_probs or shape.return_cumulative_logprob or shape.return_logprobs
        sp.top_logprobs = (shape.top_logprobs or 0) if shape.return_logprobs else 0
        sp.return_generation_logits = shape.return_generation_logits
        sp.return_context_logits = shape.return_context_logits
        if not p.exclude_input:
            p.echo_text, p.echo_ids = _echo(p.request, ctx.tokenizer)
    return out


MAX_RETURN_SEQUENCES = 16


def _parse_prompt(row: _Row, req: Request) -> None:
    if "text_input" in row.tensors:
        req.prompt = row.str("text_input")
        if not req.prompt:
            raise InvalidRequestError("text_input is empty")
        return
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


def _response_shape(row: _Row, ctx: _Context, vllm_params: Optional[dict]) -> ParsedRequest:
    """How the row's responses look (a ParsedRequest without its engine request yet)."""
    stream = bool(row.bool("stream"))
    exclude = row.bool("exclude_input_in_output")
    p = ParsedRequest(request=None, interface=ctx.interface, stream=stream, batch_index=row.b,
                      return_num_input_tokens=bool(row.bool("return_num_input_tokens")),
                      return_num_output_tokens=bool(row.bool("return_num_output_tokens")))
    if ctx.interface == "vllm":
        if stream and exclude is False:
            raise InvalidRequestError("When streaming, `exclude_input_in_output` = False is not allowed.")
        p.exclude_input = stream if exclude is None else exclude
        p.return_finish_reason = bool(row.bool("return_finish_reason"))
        p.return_cumulative_logprob = bool(row.bool("return_cumulative_logprob"))
        p.return_logprobs = bool(row.bool("return_logprobs"))
        n = (vllm_params or {}).get("logprobs")
        if n is not None:
            p.top_logprobs = _as_int(n, "logprobs")
            if not 0 <= p.top_logprobs <= VLLM_MAX_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be in [0, {VLLM_MAX_LOGPROBS}], got {p.top_logprobs}")
    else:
        if stream and ctx.interface == "unary":
            raise InvalidRequestError("stream=true needs a decoupled model: send streaming requests to `specguide`")
        # TensorRT-LLM: the prompt is part of a whole response unless excluded, and never streamed
        p.exclude_input = True if stream else bool(exclude)
        p.return_perf_metrics = bool(row.bool("return_perf_metrics"))
        p.return_log_probs = bool(row.bool("return_log_probs"))
        p.return_context_logits = bool(row.bool("return_context_logits"))
        p.return_generation_logits = bool(row.bool("return_generation_logits"))
        _check_neutral("beam_width", row.int("beam_width"), 1)
    return p


def _apply_tensor_sampling(row: _Row, sp: SamplingParams, explicit_sampling: bool, tokenizer: Any) -> None:
    """TensorRT-LLM tensors. Greedy unless temperature, top_k or top_p is given (TRT-LLM's rule);
    `top_k` / `top_p` <= 0 mean unset, as TensorRT-LLM's clients send 0 by default."""
    temperature, top_k, top_p = row.float("temperature"), row.int("top_k"), row.float("top_p")
    top_k = top_k if top_k is not None and top_k > 0 else None
    top_p = top_p if top_p is not None and top_p > 0 else None
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
    if min_tokens is not None:
        sp.min_tokens = min_tokens
    seed = row.int("seed")
    if seed is not None:
        sp.seed = seed
    end_id = row.int("end_id")
    if end_id is not None:
        sp.end_id = end_id
    # stop words end the sequence on their token sequences and stay in the output (TensorRT-LLM)
    stop = _encode_words(row.strs("stop_words"), tokenizer) + row.word_lists("stop_words_list")
    if stop:
        sp.stop_token_seqs = list(sp.stop_token_seqs) + stop
    bad = _encode_words(row.strs("bad_words"), tokenizer) + row.word_lists("bad_words_list")
    if bad:
        sp.bad_words_ids = list(sp.bad_words_ids) + bad
    for key in _PENALTIES:  # checked by SamplingParams.validate; they do not turn sampling on
        v = row.float(key)
        if v is not None:
            setattr(sp, key, v)


# Sampling penalties: the TensorRT-LLM tensors and the vLLM keys have the same names.
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")

# vLLM SamplingParams fields we accept only at their neutral value, and fields we ignore.
_VLLM_NEUTRAL = {
    "n": 1, "best_of": 1, "prompt_logprobs": 0, "use_beam_search": False, "length_penalty": 1.0,
    "min_p": 0.0, "include_stop_str_in_output": False,
}
_VLLM_INTS = ("max_tokens", "min_tokens", "top_k", "seed")
_VLLM_FLOATS = ("temperature", "top_p") + _PENALTIES
# accepted and without effect here: output formatting vLLM does its own way, and the LoRA name
# (null only), the structured-output backend options (read by guided.params)
_VLLM_IGNORED = ("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "output_kind",
                 "truncate_prompt_tokens", "lora_name", "logprobs", "structured_outputs", "guided_decoding",
                 "max_completion_tokens", "stop", "stop_token_ids", "ignore_eos", "bad_words", "early_stopping",
                 "extra_args")
VLLM_SAMPLING_KEYS = frozenset(_VLLM_INTS + _VLLM_FLOATS + tuple(_VLLM_NEUTRAL) + _VLLM_IGNORED)


DEFAULT_JSON_DEPTH = InputLimits().max_json_depth


def _parse_json_object(text: Any, what: str, max_depth: int = DEFAULT_JSON_DEPTH) -> dict[str, Any]:
    if isinstance(text, dict):
        return text
    if isinstance(text, bytes):
        text = _as_str(text, what)
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a JSON object (as a string)")
    d = check_json_text(text, what, max_depth)  # refuses deep nesting before json.loads recurses
    if not isinstance(d, dict):
        raise InvalidRequestError(f"{what} must be a JSON object")
    return d


def _from_vllm(d: dict[str, Any], tokenizer: Any) -> SamplingParams:
    """The vLLM backend's `sampling_parameters`, with vLLM's defaults (max_tokens 16, temperature 1.0).

    Values may be strings ("max_tokens": "16"), as genai-perf sends them. A key vLLM does not know
    is an error naming it. The guide (`structured_outputs` / `guided_decoding`) is read by
    guided.params.resolve_guided.
    """
    unknown = [k for k in d if k not in VLLM_SAMPLING_KEYS]
    if unknown:
        raise InvalidRequestError(f"sampling_parameters: unknown key '{unknown[0]}'")
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
    if stop is not None:
        if isinstance(stop, str):
            sp.stop = [stop] if stop else []
        elif isinstance(stop, list):
            sp.stop = [_as_str(s, "each stop string") for s in stop if s != ""]
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {_json_type(stop)}")
    if d.get("stop_token_ids") is not None:
        ids = [_as_int(t, "each stop_token_ids entry") for t in _as_list(d["stop_token_ids"], "stop_token_ids")]
        if any(t < 0 or t >= 2**31 for t in ids):
            raise InvalidRequestError("stop_token_ids must be token ids (integers >= 0 inside the vocabulary)")
        sp.stop_token_ids = ids
    if d.get("ignore_eos") is not None:
        sp.ignore_eos = bool(_as_bool(d["ignore_eos"], "ignore_eos"))
    if d.get("bad_words") is not None:
        words = [d["bad_words"]] if isinstance(d["bad_words"], str) else _as_list(d["bad_words"], "bad_words")
        sp.bad_words_ids = _encode_words([_as_str(w, "each bad_words entry") for w in words], tokenizer)
    if d.get("lora_name") is not None:
        raise UnsupportedError(f"lora_name={d['lora_name']!r} is not supported (no LoRA adapters are loaded)")
    for key, neutral in _VLLM_NEUTRAL.items():
        v = d.get(key)
        if v is not None:
            _check_neutral(key, _as_bool(v, key) if isinstance(neutral, bool) else _as_float(v, key), neutral)
    return sp


# --------------------------------------------------------------------------------------------
# Small converters
# --------------------------------------------------------------------------------------------


def _echo(req: Request, tokenizer: Any) -> tuple[str, list[int]]:
    if req.prompt is not None and req.prompt_ids is not None:  # tokenized once in _parse_row
        return req.prompt, list(req.prompt_ids)
    if req.prompt is not None:
        ids = list(tokenizer.encode(req.prompt)) if tokenizer is not None else []
        return req.prompt, ids
    text = tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""
    return text, list(req.prompt_ids)


def _encode_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    if not words:
        return []
    if tokenizer is None:
        raise InvalidRequestError("stop/bad words need a tokenizer")
    return [list(tokenizer.encode(w)) for w in words if w]


def _check_neutral(name: str, value: Any, neutral: Any) -> None:
    if value is not None and value != neutral:
        raise UnsupportedError(f"{name}={value} is not supported (only {neutral})")


def _json_type(v: Any) -> str:
    """The JSON name of a parsed value's type (what a client wrote), for messages."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def _as_str(v: Any, name: str) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise InvalidRequestError(f"{name} must be a string, got {_json_type(v)}")


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
    raise InvalidRequestError(f"{name} must be a list, got {_json_type(v)}")

