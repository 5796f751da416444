"""One Triton gRPC stream per request, to the `specguide` model (its TensorRT-LLM interface).

`TritonClient.generate()` opens a bidirectional `ModelStreamInfer` call, sends one request and
yields its responses as `Delta`s until Triton's final flag. Leaving the iteration early (the HTTP
client went away, an error) cancels the gRPC call, which cancels the request in Triton and frees
its engine slot. Errors come back with their codes as the output `specguide_error` (asked for by
a request parameter), so a bad request, a full queue and a fault can be told apart.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor

from ..triton.interfaces import ERROR_OUTPUT_PARAMETER, PROXY_ERROR
from .errors import ApiError, ErrorType, from_triton

MODEL = "specguide"
_IDS = itertools.count(1)


@dataclass
class TritonRequest:
    """What one OpenAI prompt becomes: the prompt text and the `specguide` inputs."""

    prompt: str
    sampling: dict[str, Any]  # the vLLM `sampling_parameters` JSON (sampling, stop, guide, logprobs)
    stream: bool = True
    n: int = 1  # num_return_sequences
    num_draft_tokens: Optional[int] = None
    logprobs: bool = False  # return_logprobs: the `logprobs` output (vLLM JSON)
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


def _tensor(name: str, value: Any, dtype: Any, datatype: str) -> tuple[Any, bytes]:
    arr = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
    if dtype is np.object_:
        arr = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in arr.reshape(-1)]], dtype=np.object_)
        raw = serialize_byte_tensor(arr).item()
    else:
        raw = arr.tobytes()
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(arr.shape)), raw


_WANTED = ("text_output", "finish_reason", "sequence_index", "num_input_tokens", "num_output_tokens", PROXY_ERROR)


def build_request(req: TritonRequest, request_id: str, model: str = MODEL) -> Any:
    """The ModelInferRequest protobuf for one TritonRequest ([1, 1] tensors)."""
    inputs = [
        ("text_input", req.prompt, np.object_, "BYTES"),
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
    for name in _WANTED + (("logprobs",) if req.logprobs else ()):  # less to send and parse per token
        msg.outputs.append(service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name))
    for name, value, dtype, datatype in inputs:
        tensor, raw = _tensor(name, value, dtype, datatype)
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
    return d


async def _close_writing(call: Any) -> None:
    try:
        await call.done_writing()
    except grpc.aio.AioRpcError:  # the call is already over
        pass


class TritonClient:
    """A gRPC channel to one tritonserver; `generate` streams one request's responses."""

    def __init__(self, url: str, model: str = MODEL):
        self.url, self.model = url, model
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self._channel = grpc.aio.insecure_channel(url, options=options)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def ready(self) -> bool:
        """Triton is live and the model is ready."""
        try:
            r = await self._stub.ModelReady(service_pb2.ModelReadyRequest(name=self.model), timeout=5)
            return bool(r.ready)
        except grpc.aio.AioRpcError:
            return False

    async def parameters(self) -> dict[str, str]:
        """The model's config.pbtxt `parameters` (engine settings), {} if Triton cannot say."""
        try:
            r = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=self.model), timeout=10)
        except grpc.aio.AioRpcError:
            return {}
        return {k: v.string_value for k, v in r.config.parameters.items()}

    async def generate(self, req: TritonRequest) -> AsyncIterator[Delta]:
        """Send `req` on a fresh stream; yield its Deltas until the final response.

        Raises ApiError for an error response. Closing the iterator early cancels the request."""
        # NOTE: written with call.write, not a request iterator (grpc.aio runs one in a task of its
        # own); our side stays open until the answer is complete, then done_writing ends the call
        call = self._stub.ModelStreamInfer()
        ended = False  # Triton has sent its last word: the call must not be cancelled then
        try:
            await call.write(build_request(req, f"oai-{next(_IDS)}", self.model))
            async for response in call:
                if response.error_message:
                    ended = True
                    raise from_triton("", response.error_message, req.guide_param)
                try:
                    delta = parse_response(response.infer_response)
                except TritonError as e:
                    ended = True
                    raise from_triton(e.code, e.message, req.guide_param) from None
                if delta is not None:
                    yield delta
                params = response.infer_response.parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    ended = True
                    return
            ended = True
            raise ApiError(502, "Triton closed the stream before the final response", ErrorType.SERVER)
        except grpc.aio.AioRpcError as e:
            ended = True
            raise from_triton(e.code().name, e.details() or str(e.code()), req.guide_param) from None
        finally:
            if ended:
                await _close_writing(call)  # our side closes: Triton ends the call
            else:
                # we left early (the HTTP client went away): Triton cancels the request. Only then:
                # Triton 2.51 can crash on a cancellation that reaches a call it has completed
                call.cancel()
