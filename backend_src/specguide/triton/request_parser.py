"""One Triton request -> the engine's requests: each row b of a request with batch size B, and
each of that row's return sequences, becomes one `ParsedRequest` (one engine sequence); its
responses carry `batch_index = b`.

Inputs follow the TensorRT-LLM ensemble (`text_input`, `max_tokens`, `temperature`, ...) and the
vLLM backend's `sampling_parameters` JSON string. Reading the request is `request_inputs`; the
TensorRT-LLM sampling tensors are `trtllm_params`, the vLLM JSON `vllm_params`; typed tensor access
and value checks are `values`; the guide (`guided_decoding_guide_type` / `guided_decoding_guide`,
or vLLM's `structured_outputs` / `guided_decoding`) is read and checked by `specguide.guided.params`,
the one mapping of guides. Every function here is pure.
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
from ..guided.limits import check_guide_text
from ..guided.params import resolve_guided
from ..request import InvalidRequestError, Request, SamplingParams, check_token_ids
from .input_limits import InputLimits, check_inputs
from .request_inputs import CLIENT_PARAMETERS, FAULT_PARAMETER, check_names, interface_of
from .trtllm_params import apply_trtllm_sampling
from .values import Row, as_int, as_str, check_neutral, parse_json_object
from .vllm_params import VLLM_MAX_LOGPROBS, VLLM_SAMPLING_KEYS, sampling_from_vllm

MAX_RETURN_SEQUENCES = 16


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
    tensors = check_names(tensors, parameters, interface)
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
        apply_trtllm_sampling(row, sp, explicit_sampling=bool(sp_json), tokenizer=ctx.tokenizer, limits=ctx.limits)
    elif sp.prompt_logprobs is not None:  # vLLM's backend has no output for them (its config: ours)
        check_neutral("prompt_logprobs", sp.prompt_logprobs, 0)
        sp.prompt_logprobs = None
    sp.validate(ctx.max_tokens_limit, ctx.limits.vocab_size, ctx.limits.lists)  # the engine's intake asks again
    base.params = sp
    if vllm_params is not None and vllm_params.get("lora_name") is not None:  # the engine checks the name
        base.lora_name = as_str(vllm_params["lora_name"], "lora_name")
    _parse_lora_task(row, base)

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
    base.fault = faults.checked(row.parameters.get(FAULT_PARAMETER))  # tests; a bad name is INVALID_ARG

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


def _parse_lora_task(row: Row, req: Request) -> None:
    """TensorRT-LLM's LoRA inputs: `lora_task_id`, and the first time `lora_weights` [n, size] with
    `lora_config` [n, 3] (the engine checks them against the model)."""
    req.lora_task_id = row.int("lora_task_id")
    for name in ("lora_weights", "lora_config"):
        arr = row.tensors.get(name)
        if arr is None:
            continue
        arr = np.asarray(arr)
        one = arr[row.b] if arr.ndim == 3 else arr  # [batch, n, ...]: this row's
        if one.ndim != 2 or (name == "lora_config" and one.shape[1] != 3):
            raise InvalidRequestError(f"{name} must be [n, {'3' if name == 'lora_config' else 'size'}] per request, "
                                      f"got {list(arr.shape)}")
        setattr(req, name, np.ascontiguousarray(one))


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


def _echo(req: Request, tokenizer: Any) -> tuple[str, list[int]]:
    if req.prompt is not None and req.prompt_ids is not None:  # tokenized once in _parse_row
        return req.prompt, list(req.prompt_ids)
    if req.prompt is not None:
        ids = list(tokenizer.encode(req.prompt)) if tokenizer is not None else []
        return req.prompt, ids
    text = tokenizer.decode(req.prompt_ids) if tokenizer is not None else ""
    return text, list(req.prompt_ids)


