"""Triton tensors <-> engine messages. The only place that knows tensor names and dtypes.

Inputs follow the TensorRT-LLM ensemble (`text_input`, `max_tokens`, `temperature`, ...) and the
vLLM backend's `sampling_parameters` JSON string. The guide (`guided_decoding_guide_type` /
`guided_decoding_guide`, or vLLM's `structured_outputs` / `guided_decoding`) is read and checked by
`specguide.guided.params`, the one mapping of guides. Typed tensor access and value checks are in
`values`, the vLLM JSON in `vllm_params`, responses in `responses`. Every function here is pure:
the Triton module (`triton_python_backend_utils`) is passed in as `pb` where a Triton object must be
built, so the unit tests run with a tiny fake of it.

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

from ..engine import faults
from ..guided.limits import check_guide_text, check_json_text
from ..guided.params import resolve_guided
from ..request import InvalidRequestError, Request, SamplingParams, check_token_ids
from .interfaces import ALIASES, ERROR_OUTPUT_PARAMETER, INTERFACE_PARAMETER, SERVED_MODEL_PARAMETER, \
    SERVED_VERSION_PARAMETER, TRTLLM_INPUT_NAMES, TRTLLM_INPUTS, TRTLLM_OUTPUTS, VLLM_INPUT_NAMES, Spec
from .input_limits import InputLimits, check_inputs
from .values import DEFAULT_JSON_DEPTH, Row, as_int, check_neutral, encode_words, parse_json_object
from .vllm_params import PENALTIES, VLLM_MAX_LOGPROBS, VLLM_SAMPLING_KEYS, sampling_from_vllm
from .responses import (  # noqa: F401  (re-exported: the adapter and the tests use io.*)
    VLLM_ERROR_PREFIX, Payload, SequenceStream, UnsupportedError, error_code, error_response, event_error_code, merge_payloads,
    safe_send, to_response,
)


INPUTS: tuple[Spec, ...] = TRTLLM_INPUTS  # the `specguide` model's inputs (the union of the interfaces)
OUTPUTS: tuple[Spec, ...] = TRTLLM_OUTPUTS
INPUT_NAMES = tuple(s.name for s in INPUTS)
FAULT_PARAMETER = "specguide_fault"  # request parameter naming an injected fault (specguide.engine.faults)
CLIENT_PARAMETERS = "specguide_client_parameters"  # a proxy's client's parameters, as a JSON string
# request parameters every interface accepts: internal ones, and the `Streaming` flag that
# TensorRT-LLM's inflight_batcher_llm_client sends beside its tensors (ignored there as here)
FAULTS = faults.injector()  # on only with SPECGUIDE_FAULT_INJECTION=1
_KNOWN_PARAMETERS = frozenset({FAULT_PARAMETER, INTERFACE_PARAMETER, CLIENT_PARAMETERS, ERROR_OUTPUT_PARAMETER,
                               SERVED_MODEL_PARAMETER, SERVED_VERSION_PARAMETER, "Streaming"})


def wants_error_output(parameters: dict[str, Any]) -> bool:
    """The client asked for its errors as the output PROXY_ERROR ([code, message]); the proxies get them so anyway."""
    return parameters.get(ERROR_OUTPUT_PARAMETER) is True


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
        parameters.update(parse_json_object(client, "request parameters", limits.max_json_depth))
    tensors = _check_names(tensors, parameters, interface)
    ctx = _Context(interface, default_max_tokens, max_tokens_limit, tokenizer, request_id, limits)
    rows = []
    for b in range(_batch_size(tensors)):
        rows.extend(_parse_row(Row(tensors, parameters, b), ctx))
    return rows


@dataclass
class _Context:
    interface: str
    default_max_tokens: int
    max_tokens_limit: int
    tokenizer: Any
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


def _parse_row(row: Row, ctx: _Context) -> list[ParsedRequest]:
    vllm = ctx.interface == "vllm"
    base = Request(request_id=ctx.request_id)
    _parse_prompt(row, base, ctx.limits.vocab_size)

    # sampling: vLLM JSON first (with vLLM's defaults), then the individual tensors override it
    sp_json = row.str("sampling_parameters")
    if vllm and not sp_json:  # the vLLM backend reads the request parameters instead of the tensor
        sp_json = json.dumps({k: v for k, v in row.parameters.items() if k in VLLM_SAMPLING_KEYS})
    if sp_json:
        vllm_params = parse_json_object(sp_json, "sampling_parameters", ctx.limits.max_json_depth)
        sp = sampling_from_vllm(vllm_params, ctx.tokenizer, ctx.limits.vocab_size, ctx.limits.lists)
    else:
        vllm_params, sp = None, SamplingParams(max_tokens=ctx.default_max_tokens, temperature=0.0)
    if not vllm:
        _apply_tensor_sampling(row, sp, explicit_sampling=bool(sp_json), tokenizer=ctx.tokenizer, limits=ctx.limits)
    elif sp.prompt_logprobs is not None:  # vLLM's backend has no output for them (its config: ours)
        check_neutral("prompt_logprobs", sp.prompt_logprobs, 0)
        sp.prompt_logprobs = None
    sp.validate(ctx.max_tokens_limit, ctx.limits.vocab_size, ctx.limits.lists)  # the engine's intake asks again
    base.params = sp

    # guided decoding: the TensorRT-LLM tensors or the vLLM JSON (one guide; guided.params checks it)
    gtype, guide = row.str("guided_decoding_guide_type"), row.str("guided_decoding_guide")
    check_guide_text(gtype, guide, ctx.limits.guide)  # bytes and nesting, before anything parses it
    base.guided = resolve_guided(gtype, guide, vllm_params)

    k = row.int("num_draft_tokens")
    if k is not None and k < 0:
        raise InvalidRequestError(f"num_draft_tokens must be >= 0, got {k}")
    base.num_draft_tokens = k
    timeout = row.float("timeout_s")
    if timeout is not None and not (0.0 <= timeout < math.inf):
        raise InvalidRequestError(f"timeout_s must be a finite number >= 0 (0 = none), got {timeout}")
    base.timeout_s = timeout
    base.fault = FAULTS.checked(row.parameters.get(FAULT_PARAMETER))  # tests; a bad name is INVALID_ARG

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


def _parse_prompt(row: Row, req: Request, vocab_size: int) -> None:
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
    if ids.dtype.kind not in "iu":
        raise InvalidRequestError(f"input_ids must hold integers (token ids), got {ids.dtype}")
    check_token_ids(ids, "input_ids", vocab_size)
    req.prompt_ids = [int(i) for i in ids]


def _response_shape(row: Row, ctx: _Context, vllm_params: Optional[dict]) -> ParsedRequest:
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
        p.top_logprobs = _top_logprobs(vllm_params)
    else:
        if stream and ctx.interface == "unary":
            raise InvalidRequestError("stream=true needs a decoupled model: send streaming requests to `specguide`")
        # TensorRT-LLM: the prompt is part of a whole response unless excluded, and never streamed
        p.exclude_input = True if stream else bool(exclude)
        p.return_perf_metrics = bool(row.bool("return_perf_metrics"))
        p.return_log_probs = bool(row.bool("return_log_probs"))
        p.return_context_logits = bool(row.bool("return_context_logits"))
        p.return_generation_logits = bool(row.bool("return_generation_logits"))
        p.return_logprobs = bool(row.bool("return_logprobs"))  # vLLM's JSON: each token and the top N
        if p.return_logprobs:
            p.top_logprobs = _top_logprobs(vllm_params) or 0
        check_neutral("beam_width", row.int("beam_width"), 1)
    return p


def _top_logprobs(vllm_params: Optional[dict]) -> Optional[int]:
    """vLLM's `logprobs: N` of `sampling_parameters` (None when absent)."""
    n = (vllm_params or {}).get("logprobs")
    if n is None:
        return None
    n = as_int(n, "logprobs")
    if not 0 <= n <= VLLM_MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be in [0, {VLLM_MAX_LOGPROBS}], got {n}")
    return n


def _apply_tensor_sampling(row: Row, sp: SamplingParams, explicit_sampling: bool, tokenizer: Any,
                           limits: InputLimits) -> None:
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
    vocab, lists = limits.vocab_size, limits.lists
    end_id = row.int("end_id")
    if end_id is not None:
        check_token_ids((end_id,), "end_id", vocab)
        sp.end_id = end_id
    pad_id = row.int("pad_id")  # not used here (no padding), but a token id all the same
    if pad_id is not None:
        check_token_ids((pad_id,), "pad_id", vocab)
    # stop words end the sequence on their token sequences and stay in the output (TensorRT-LLM);
    # strings are counted before they are tokenized, lists before their words are built
    stop = _words(row, "stop_words", tokenizer, lists, "max_stop_words")
    stop += row.word_lists("stop_words_list", lists, "max_stop_words", vocab)
    if stop:
        sp.stop_token_seqs = list(sp.stop_token_seqs) + stop
    bad = _words(row, "bad_words", tokenizer, lists, "max_bad_words")
    bad += row.word_lists("bad_words_list", lists, "max_bad_words", vocab)
    if bad:
        sp.bad_words_ids = list(sp.bad_words_ids) + bad
    for key in PENALTIES:  # checked by SamplingParams.validate; they do not turn sampling on
        v = row.float(key)
        if v is not None:
            setattr(sp, key, v)
    bias = _embedding_bias(row, tokenizer, vocab)
    if bias:
        sp.logit_bias = {**sp.logit_bias, **bias}


def _words(row: Row, name: str, tokenizer: Any, lists: Any, setting: str) -> list[list[int]]:
    """The token ids of each of a STRING tensor's words (stop_words, bad_words), counted first."""
    words = row.strs(name)
    lists.check(name, len(words), "words", setting)
    return encode_words(words, tokenizer)


def _embedding_bias(row: Row, tokenizer: Any, vocab_size: int) -> dict[int, float]:
    """TensorRT-LLM's logit bias as {token id: bias}: the ensemble's words and weights (each of a
    word's token ids gets its weight added, as its preprocessing does) and `tensorrt_llm`'s dense
    `embedding_bias` (its nonzero entries; one value per token id of the model's vocabulary, as
    TensorRT-LLM requires: another length is an error). Clamped to +-100 (the engine's range; past
    it a token is already banned or forced)."""
    bias: dict[int, float] = {}
    words, weights = row.strs("embedding_bias_words"), row.values("embedding_bias_weights")
    weights = [] if weights is None else [float(w) for w in weights.reshape(-1)]
    if len(words) != len(weights):
        raise InvalidRequestError(f"embedding_bias_words has {len(words)} words and embedding_bias_weights "
                                  f"{len(weights)} weights; they go in pairs")
    for word, weight in zip(words, weights):
        ids = encode_words([word], tokenizer)[0] if word else []
        check_token_ids(ids, "embedding_bias_words", vocab_size)
        for t in ids:
            bias[t] = bias.get(t, 0.0) + weight
    dense = row.values("embedding_bias")
    if dense is not None and dense.size:  # the ensemble sends [B, 0] when it has no bias words
        dense = dense.reshape(-1)
        if vocab_size and dense.size != vocab_size:
            raise InvalidRequestError(f"embedding_bias has {dense.size} values; it takes one per token id of the "
                                      f"model's vocabulary: {vocab_size}")
        for t in np.flatnonzero(dense).tolist():
            bias[t] = bias.get(t, 0.0) + float(dense[t])
    if any(not np.isfinite(v) for v in bias.values()):
        raise InvalidRequestError("embedding bias values must be finite numbers")
    return {t: min(max(v, -100.0), 100.0) for t, v in bias.items()}


def _echo(req: Request, tokenizer: Any) -> tuple[str, list[int]]:
    if req.prompt is not None and req.prompt_ids is not None:  # tokenized once in _parse_row
        return req.prompt, list(req.prompt_ids)
    if req.prompt is not None:
        ids = list(tokenizer.encode(req.prompt)) if tokenizer is not None else []
        return req.prompt, ids
    text = tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""
    return text, list(req.prompt_ids)


