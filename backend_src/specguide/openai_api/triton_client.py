"""One Triton gRPC stream per request, to the `specguide` model (its TensorRT-LLM interface).

`TritonClient.generate()` opens a bidirectional `ModelStreamInfer` call, sends one request and
yields its responses as `Delta`s until Triton's final flag. Leaving the iteration early (the HTTP
client went away, an error) resets the HTTP/2 stream, which cancels the request in Triton and
frees its engine slot. Errors come back with their codes as the output `specguide_error` (asked
for by a request parameter), so a bad request, a full queue and a fault can be told apart.

gRPC through grpclib (HTTP/2 in the event loop's own thread), not grpc.aio: with no connection
grpclib connects when a request comes, where a grpc.aio channel that lost Triton retries on its
own backoff (up to 2 minutes) and fails requests meanwhile, though Triton is back; and it spends
less CPU per streamed token (no C-core threads and poller between the loop and the socket).
"""
from __future__ import annotations

import functools
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import numpy as np
from grpclib.client import Channel, Stream, UnaryUnaryMethod
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from ..triton.interfaces import ERROR_OUTPUT_PARAMETER, PROXY_ERROR
from ..triton.lora_control import LORA_INPUT
from .errors import ApiError, ErrorType, from_triton

MODEL = "specguide"
_SERVICE = "/inference.GRPCInferenceService/"
_DOWN = (OSError, StreamTerminatedError)  # no connection, or it broke: Triton is not serving
log = logging.getLogger("specguide.openai_api")


def new_request_id() -> str:
    """A Triton request id no one can guess: Triton's interface cancels a request by its id (a
    `stop` request, as TensorRT-LLM's), so a client that reaches Triton must not be able to name
    this server's requests. 128 random bits."""
    return "oai-" + secrets.token_hex(16)


@dataclass
class TritonRequest:
    """What one OpenAI prompt becomes: the prompt text and the `specguide` inputs."""

    prompt: Union[str, list[int]]  # text, or token ids (the `input_ids` input)
    sampling: dict[str, Any]  # the vLLM `sampling_parameters` JSON (sampling, stop, guide, logprobs)
    stream: bool = True
    n: int = 1  # num_return_sequences
    num_draft_tokens: Optional[int] = None
    logprobs: bool = False  # return_logprobs: the `logprobs` output (vLLM JSON)
    prompt_logprobs: bool = False  # the `prompt_logprobs` output (sampling's prompt_logprobs: N)
    guide_param: Optional[str] = None  # the OpenAI field that carried the guide (names Triton's 400s)


@dataclass
class Delta:
    """One response of one sequence: new text, its log probs, its end."""

    index: int  # sequence_index (which of the n)
    text: str = ""
    finish_reason: Optional[str] = None  # stop | length | timeout on the sequence's last response
    num_input_tokens: Optional[int] = None
    num_output_tokens: int = 0
    logprobs: Optional[list[dict[str, dict]]] = None  # per token {id: {logprob, rank, decoded_token}}
    prompt_logprobs: Optional[list[dict[str, dict]]] = None  # per prompt token, the same (the first: logprob null)


def _tensor(name: str, value: Any, dtype: Any, datatype: str) -> tuple[Any, bytes]:
    arr = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
    if dtype is np.object_:
        arr = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in arr.reshape(-1)]], dtype=np.object_)
        raw = serialize_byte_tensor(arr).item()
    else:
        raw = arr.tobytes()
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(arr.shape)), raw


_scalar = functools.lru_cache(maxsize=64)(_tensor)  # the flags and counts: the same few tensors every request


_WANTED = ("text_output", "finish_reason", "sequence_index", "num_input_tokens", "num_output_tokens", PROXY_ERROR)


@functools.lru_cache(maxsize=8)
def _requested(logprobs: bool, prompt_logprobs: bool) -> list[Any]:
    names = _WANTED + (("logprobs",) if logprobs else ()) + (("prompt_logprobs",) if prompt_logprobs else ())
    return [service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in names]


def build_request(req: TritonRequest, request_id: str, model: str = MODEL) -> Any:
    """The ModelInferRequest protobuf for one TritonRequest ([1, 1] tensors)."""
    prompt = ("input_ids", req.prompt, np.int32, "INT32") if isinstance(req.prompt, list) else \
        ("text_input", req.prompt, np.object_, "BYTES")
    inputs = [
        prompt,
        ("stream", req.stream, np.bool_, "BOOL"),
        ("exclude_input_in_output", True, np.bool_, "BOOL"),
        ("sampling_parameters", json.dumps(req.sampling), np.object_, "BYTES"),
        ("return_num_input_tokens", True, np.bool_, "BOOL"),
        ("return_num_output_tokens", True, np.bool_, "BOOL"),
    ]
    if req.n != 1:
        inputs.append(("num_return_sequences", req.n, np.int32, "INT32"))
    if req.num_draft_tokens is not None:
        inputs.append(("num_draft_tokens", req.num_draft_tokens, np.int32, "INT32"))
    if req.logprobs:
        inputs.append(("return_logprobs", True, np.bool_, "BOOL"))
    msg = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    msg.outputs.extend(_requested(req.logprobs, req.prompt_logprobs))  # copies (protobuf)
    for name, value, dtype, datatype in inputs:
        tensor, raw = (_scalar if isinstance(value, (bool, int)) else _tensor)(name, value, dtype, datatype)
        msg.inputs.append(tensor)
        msg.raw_input_contents.append(raw)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    msg.parameters[ERROR_OUTPUT_PARAMETER].bool_param = True  # errors come as PROXY_ERROR [code, message]
    return msg


class TritonError(Exception):
    """An error response: the model's code (INVALID_ARG, UNAVAILABLE, ...) and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


_DTYPES = {"INT32": np.int32, "UINT32": np.uint32, "INT64": np.int64, "FP32": np.float32, "BOOL": np.bool_}


def _strings(raw: bytes) -> list[bytes]:
    """A BYTES tensor's raw contents: each element a 4-byte little-endian length, then its bytes."""
    out, i = [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i:i + 4], "little")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _outputs(response: Any) -> dict[str, Any]:
    """The response's outputs by name: BYTES as lists of bytes, the rest as flat numpy arrays.
    (Read from the raw contents directly: tritonclient's InferResult costs more per token.)"""
    out = {}
    for spec, raw in zip(response.outputs, response.raw_output_contents):
        out[spec.name] = _strings(raw) if spec.datatype == "BYTES" else np.frombuffer(raw, dtype=_DTYPES[spec.datatype])
    return out


def parse_response(response: Any) -> Optional[Delta]:
    """A ModelInferResponse -> Delta (None for an empty final response); raises TritonError for an error."""
    if not response.outputs:
        return None
    out = _outputs(response)
    if PROXY_ERROR in out:
        code, message = (v.decode("utf-8", "replace") for v in out[PROXY_ERROR][:2])
        raise TritonError(code, message)
    reason = out["finish_reason"][0].decode() if out.get("finish_reason") else ""
    d = Delta(index=int(out["sequence_index"][0]) if "sequence_index" in out else 0,
              text=b"".join(out.get("text_output", [])).decode("utf-8", errors="replace"),
              finish_reason=reason or None)
    if "num_input_tokens" in out:
        d.num_input_tokens = int(out["num_input_tokens"][0])
    if "num_output_tokens" in out:
        d.num_output_tokens = int(out["num_output_tokens"][0])
    if out.get("logprobs"):
        d.logprobs = json.loads(out["logprobs"][0]) or []
    if out.get("prompt_logprobs"):
        d.prompt_logprobs = json.loads(out["prompt_logprobs"][0])
    return d


def _is_final(response: Any) -> bool:
    params = response.infer_response.parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


async def _finish(call: Stream) -> None:
    """Triton's status is read (GRPCError if the call failed): the call ends without a reset
    (Triton 2.51 can crash on a cancellation that reaches a call it has completed)."""
    await call.recv_trailing_metadata()


def split_url(url: str) -> tuple[str, int]:
    """"HOST:PORT" (an IPv6 host in brackets) -> (host, port)."""
    host, sep, port = url.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"Triton's gRPC URL must be HOST:PORT, not {url!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class TritonClient:
    """A gRPC channel to one tritonserver; `generate` streams one request's responses. Made in the
    event loop that uses it (the channel's connection belongs to that loop)."""

    def __init__(self, url: str, model: str = MODEL):
        self.url, self.model = url, model
        host, port = split_url(url)
        self._channel = Channel(host, port)  # connects on first use, and again after Triton restarts

    async def close(self) -> None:
        self._channel.close()

    async def _unary(self, name: str, request: Any, reply: type, timeout: float) -> Any:
        method = UnaryUnaryMethod(self._channel, _SERVICE + name, type(request), reply)
        return await method(request, timeout=timeout)

    async def ready(self) -> bool:
        """Triton is live and the model is ready."""
        try:
            r = await self._unary("ModelReady", service_pb2.ModelReadyRequest(name=self.model),
                                  service_pb2.ModelReadyResponse, 5)
            return bool(r.ready)
        except (GRPCError, TimeoutError, *_DOWN):
            return False

    async def parameters(self) -> dict[str, str]:
        """The model's config.pbtxt `parameters` (engine settings), {} if Triton cannot say."""
        try:
            r = await self._unary("ModelConfig", service_pb2.ModelConfigRequest(name=self.model),
                                  service_pb2.ModelConfigResponse, 10)
        except (GRPCError, TimeoutError, *_DOWN):
            return {}
        return {k: v.string_value for k, v in r.config.parameters.items()}

    async def lora(self, control: dict[str, Any], timeout: float = 180.0) -> dict[str, Any]:
        """A LoRA control request (triton/lora_control.py: load, unload, list) and its answer's JSON.
        Raises TritonError (the model's code and message) or ApiError (Triton down: 503)."""
        msg = service_pb2.ModelInferRequest(model_name=self.model, id=new_request_id())
        tensor, raw = _tensor(LORA_INPUT, json.dumps(control), np.object_, "BYTES")
        msg.inputs.append(tensor)
        msg.raw_input_contents.append(raw)
        msg.parameters[ERROR_OUTPUT_PARAMETER].bool_param = True
        try:
            async with self._channel.request(_SERVICE + "ModelStreamInfer", Cardinality.STREAM_STREAM,
                                             service_pb2.ModelInferRequest, service_pb2.ModelStreamInferResponse,
                                             timeout=timeout) as call:
                await call.send_message(msg, end=True)
                response = await call.recv_message()
                await _finish(call)
        except GRPCError as e:
            raise from_triton(e.status.name, e.message or e.status.name) from None
        except (*_DOWN, TimeoutError) as e:
            log.warning("Triton at %s is not reachable: %s", self.url, e)
            raise from_triton("UNAVAILABLE", "Triton is not reachable") from None
        if response is None or response.error_message:
            raise TritonError("", response.error_message if response is not None else "no answer")
        delta = parse_response(response.infer_response)  # raises TritonError for the model's error
        if delta is None:
            raise TritonError("", "no answer")
        return json.loads(delta.text)

    async def generate(self, req: TritonRequest) -> AsyncIterator[Delta]:
        """Send `req` on a fresh stream; yield its Deltas until the final response.

        Raises ApiError for an error response. Closing the iterator early cancels the request."""
        ended = False  # Triton has sent its last word: the call must end, not be reset
        try:
            async with self._channel.request(_SERVICE + "ModelStreamInfer", Cardinality.STREAM_STREAM,
                                             service_pb2.ModelInferRequest,
                                             service_pb2.ModelStreamInferResponse) as call:
                try:
                    # end=True: our side closes with the request's own frame (one write less);
                    # Triton still sends every response, then its status
                    await call.send_message(build_request(req, new_request_id(), self.model), end=True)
                    async for response in call:
                        ended = bool(response.error_message) or _is_final(response)
                        if response.error_message:
                            raise from_triton("", response.error_message, req.guide_param)
                        try:
                            delta = parse_response(response.infer_response)
                        except TritonError as e:
                            ended = True
                            raise from_triton(e.code, e.message, req.guide_param) from None
                        if delta is not None:
                            yield delta
                        if ended:
                            return
                    await _finish(call)  # raises GRPCError for a failed call
                    raise ApiError(502, "Triton closed the stream before the final response", ErrorType.SERVER)
                finally:
                    if ended:
                        try:
                            await _finish(call)
                        except (GRPCError, *_DOWN):  # the call is over either way
                            pass
                    # else we leave early (the HTTP client went away), or the call is closed: the
                    # block's exit resets a stream still open, and Triton cancels the request
        except GRPCError as e:
            raise from_triton(e.status.name, e.message or e.status.name, req.guide_param) from None
        except _DOWN as e:  # the address stays in the log: clients are not told where the back end is
            log.warning("Triton at %s is not reachable: %s", self.url, e)
            raise from_triton("UNAVAILABLE", "Triton is not reachable", req.guide_param) from None
