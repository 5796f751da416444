"""What a Triton request carries, read and checked: its tensors, its parameters, the interface it
came through, TensorRT-LLM's stop signal, and the names each interface accepts.

The Triton module (`triton_python_backend_utils`) is passed in as `pb`, so the unit tests run with
a tiny fake of it. Turning what is read here into engine requests is `request_parser`.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..guided.limits import check_json_text
from ..request import InvalidRequestError
from .input_limits import InputLimits, check_inputs
from .interfaces import ALIASES, ERROR_OUTPUT_PARAMETER, INTERFACE_PARAMETER, SERVED_MODEL_PARAMETER, \
    SERVED_VERSION_PARAMETER, TRTLLM_INPUT_NAMES, TRTLLM_INPUTS, VLLM_INPUT_NAMES
from .responses import UnsupportedError
from .values import DEFAULT_JSON_DEPTH
from .vllm_params import VLLM_SAMPLING_KEYS

INPUT_NAMES = tuple(s.name for s in TRTLLM_INPUTS)  # the `specguide` model's inputs (the union of the interfaces)
FAULT_PARAMETER = "specguide_fault"  # request parameter naming an injected fault (specguide.engine.faults)
CLIENT_PARAMETERS = "specguide_client_parameters"  # a proxy's client's parameters, as a JSON string
# request parameters every interface accepts: internal ones, and the `Streaming` flag that
# TensorRT-LLM's inflight_batcher_llm_client sends beside its tensors (ignored there as here)
_KNOWN_PARAMETERS = frozenset({FAULT_PARAMETER, INTERFACE_PARAMETER, CLIENT_PARAMETERS, ERROR_OUTPUT_PARAMETER,
                               SERVED_MODEL_PARAMETER, SERVED_VERSION_PARAMETER, "Streaming"})


def wants_error_output(parameters: dict[str, Any]) -> bool:
    """The client asked for its errors as the output PROXY_ERROR ([code, message]); the proxies get them so anyway."""
    return parameters.get(ERROR_OUTPUT_PARAMETER) is True


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


def check_names(tensors: dict[str, np.ndarray], parameters: dict[str, Any], interface: str) -> dict[str, np.ndarray]:
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
