"""Shared by the specguide.triton unit tests: a tiny fake of triton_python_backend_utils (`pb`), a
byte tokenizer, tensor builders and parse / output helpers (no server needed)."""
from __future__ import annotations

import json
from enum import IntEnum
from types import SimpleNamespace

import numpy as np

from specguide.request import RequestOutput
from specguide.triton.interfaces import INTERFACE_PARAMETER
from specguide.triton.request_inputs import CLIENT_PARAMETERS, read_parameters, read_tensors
from specguide.triton.request_parser import parse_request


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeTritonError:
    Code = IntEnum("Code", "UNKNOWN INTERNAL NOT_FOUND INVALID_ARG UNAVAILABLE UNSUPPORTED ALREADY_EXISTS CANCELLED", start=0)
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = Code  # .name, as Triton's

    def __init__(self, message, code=Code.INTERNAL):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors}
        self.err = error

    def has_error(self):
        return self.err is not None

    def error(self):
        return self.err


class FakeRequest:
    def __init__(self, inputs, parameters="{}"):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self._parameters = parameters

    def parameters(self):
        return self._parameters


pb = SimpleNamespace(
    Tensor=FakeTensor,
    TritonError=FakeTritonError,
    InferenceResponse=FakeResponse,
    get_input_tensor_by_name=lambda req, name: req.inputs.get(name),
    TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
)


class FakeTokenizer:
    """Bytes as tokens (id = byte value); the interface of specguide.tokenizer.Tokenizer."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


TOK = FakeTokenizer()


def s(*vals):  # one row of strings, batch 1: shape [1, n]
    return np.array([[v.encode() if isinstance(v, str) else v for v in vals]], dtype=np.object_)


def vllm(**sp):  # a vLLM sampling_parameters tensor
    return s(json.dumps(sp))


def f32(v):
    return np.array([[v]], np.float32)


def vtext(text):
    return np.array([text.encode()], dtype=np.object_)


def parse(inputs, parameters="{}", **kw):
    req = FakeRequest(inputs, parameters)
    kw.setdefault("tokenizer", TOK)
    kw.setdefault("max_tokens_limit", 2048)
    return parse_request(read_tensors(pb, req), read_parameters(req), **kw)


def one(inputs, **kw):
    rows = parse(inputs, **kw)
    assert len(rows) == 1
    return rows[0]


def vparse(inputs, parameters=None, **kw):
    """A request as specguide_vllm passes it on: [1]-shaped inputs given a batch dim, interface named."""
    params = {INTERFACE_PARAMETER: "vllm", CLIENT_PARAMETERS: json.dumps(parameters or {})}
    return parse({k: np.asarray(v)[None] for k, v in inputs.items()}, json.dumps(params), **kw)


def out(text, ids, finished=False, reason=None, n_in=3, n_out=0, error=None):
    return RequestOutput(seq_id=1, text=text, token_ids=ids, finished=finished, finish_reason=reason,
                         error=error, num_input_tokens=n_in, num_output_tokens=n_out)


def texts(payload):
    return payload.outputs["text_output"].reshape(-1)[0].decode()
