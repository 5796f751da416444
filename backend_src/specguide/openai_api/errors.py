"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

`ApiError` is what every layer raises; `from_triton` classifies an error that came back from
Triton by its code: the request asks the model for its errors as the output `specguide_error`
([code, message]), since a gRPC stream carries an error's message only.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional

from pydantic import ValidationError


class ErrorType(str, Enum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    UNAVAILABLE = "service_unavailable_error"
    SERVER = "server_error"


@dataclass
class ApiError(Exception):
    """An error answer: HTTP status, message, OpenAI type, the request field at fault, a code."""

    status: int
    message: str
    type: ErrorType = ErrorType.INVALID_REQUEST
    param: Optional[str] = None
    code: Optional[str] = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type.value, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, ErrorType.INVALID_REQUEST, param, code)


def unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"'{param}' is not supported here: {why}", ErrorType.INVALID_REQUEST, param,
                    "unsupported_parameter")


def _loc(loc: tuple, body: Any, missing: bool) -> str:
    """pydantic's location ('messages', 0, 'content') -> 'messages[0].content', keeping only the parts
    found in the body: the labels pydantic adds for union members (a member's type, a tag) are not.
    The last part stays when it is the key a 'missing' error names."""
    out, node = "", body
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            out, node = out + f"[{part}]", node[part]
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            out, node = out + ("." if out else "") + part, node[part]
        elif missing and i == len(loc) - 1:
            out += ("." if out else "") + str(part)
    return out


def from_validation(err: ValidationError, body: Any) -> ApiError:
    """The first invalid field of `body` as a 400 naming it (unknown fields: 'unrecognized'); of the
    errors on that field, the deepest (a union's members each fail: a content part's own error says most)."""
    errors = [(e, _loc(tuple(e.get("loc", ())), body, e.get("type") == "missing"))
              for e in err.errors(include_url=False)]
    field = errors[0][1]
    first, param = max((ep for ep in errors if ep[1] == field or ep[1].startswith((field + ".", field + "["))),
                       key=lambda ep: len(ep[1]))
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", ErrorType.INVALID_REQUEST,
                        param, "unrecognized_argument")
    if first.get("type") == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", ErrorType.INVALID_REQUEST, param,
                        "missing_required_parameter")
    return bad_request(f"Invalid value for '{param}': {first.get('msg')}", param)


# Triton error codes (the model's `specguide_error` output) and gRPC status names -> (HTTP status, type)
_CODES = {
    "INVALID_ARG": (400, ErrorType.INVALID_REQUEST),
    "UNSUPPORTED": (400, ErrorType.INVALID_REQUEST),
    "INVALID_ARGUMENT": (400, ErrorType.INVALID_REQUEST),
    "UNIMPLEMENTED": (400, ErrorType.INVALID_REQUEST),
    "NOT_FOUND": (503, ErrorType.UNAVAILABLE),  # the Triton model is not there: this server is misconfigured
    "UNAVAILABLE": (503, ErrorType.UNAVAILABLE),
    "RESOURCE_EXHAUSTED": (429, ErrorType.RATE_LIMIT),
    "DEADLINE_EXCEEDED": (503, ErrorType.UNAVAILABLE),
}
QUEUE_FULL = "waiting queue is full"  # engine/loop.py's QueueFullError text (UNAVAILABLE)
NO_ADAPTER = "is not loaded (adapters served:"  # engine/lora_adapters.py: `model` named no adapter it serves
_NOT_SERVING = ("is not ready", "unknown model", "not found", "unavailable")  # Triton's own, uncoded


def from_triton(code: str, message: str, param: Optional[str] = None) -> ApiError:
    """An error Triton answered with (its code, "" when it gave none, and message) as an OpenAI error.

    A full queue is 429 (retry later); a down engine or model 503; a request the model refused 400
    (with `param`, the field that carried the guide, when there is one); anything else 500."""
    if QUEUE_FULL in message:
        return ApiError(429, message, ErrorType.RATE_LIMIT, None, "queue_full")
    if NO_ADAPTER in message:  # `model` is neither the served model nor one of its adapters
        return ApiError(404, f"The model does not exist: {message}.", ErrorType.NOT_FOUND, "model", "model_not_found")
    if not code and any(s in message.lower() for s in _NOT_SERVING):
        code = "UNAVAILABLE"
    http, etype = _CODES.get(code, (500, ErrorType.SERVER))
    return ApiError(http, message, etype, param if http == 400 else None,
                    "invalid_value" if http == 400 else (code or "internal").lower())
