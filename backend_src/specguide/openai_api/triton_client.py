"""One Triton gRPC stream per request, to the `specguide` model (its TensorRT-LLM interface).

`TritonClient.generate()` opens a bidirectional `ModelStreamInfer` call, sends one request and
yields its responses as `Delta`s until Triton's final flag. Leaving the iteration early (the HTTP
client went away, an error) cancels the gRPC call, which cancels the request in Triton and frees
its engine slot. Errors come back with their codes as the output `specguide_error` (asked for by
a request parameter), so a bad request, a full queue and a fault can be told apart.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
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
    """One response of one sequence: new text (and ids), its log probs, its end."""

    index: int  # sequence_index (which of the n)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
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
    for name, value, dtype, datatype in inputs:
        tensor, raw = _tensor(name, value, dtype, datatype)
        msg.inputs.append(tensor)
        msg.raw_input_contents.append(raw)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    msg.parameters[ERROR_OUTPUT_PARAMETER].bool_param = True  # errors come as PROXY_ERROR [code, message]
    return msg


def _scalar(result: InferResult, name: str, names: set[str]) -> Any:
    return result.as_numpy(name).reshape(-1)[0] if name in names else None


class TritonError(Exception):
    """An error response: the model's code (INVALID_ARG, UNAVAILABLE, ...) and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def parse_response(response: Any) -> Optional[Delta]:
    """A ModelInferResponse -> Delta (None for an empty final response); raises TritonError for an error."""
    if not response.outputs:
        return None
    result = InferResult(response)
    names = {o.name for o in response.outputs}
    if PROXY_ERROR in names:
        code, message = (v.decode("utf-8", "replace") for v in result.as_numpy(PROXY_ERROR).reshape(-1)[:2])
        raise TritonError(code, message)
    text = b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8", errors="replace")
    reason = _scalar(result, "finish_reason", names)
    reason = reason.decode() if isinstance(reason, bytes) else reason
    d = Delta(index=int(_scalar(result, "sequence_index", names) or 0), text=text,
              token_ids=[int(t) for t in result.as_numpy("output_ids").reshape(-1)] if "output_ids" in names else [],
              finish_reason=reason or None)
    n_in = _scalar(result, "num_input_tokens", names)
    d.num_input_tokens = int(n_in) if n_in is not None else None
    d.num_output_tokens = int(_scalar(result, "num_output_tokens", names) or 0)
    lp = _scalar(result, "logprobs", names)
    if lp is not None:
        d.logprobs = json.loads(lp.decode() if isinstance(lp, bytes) else lp) or []
    return d


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
        done = asyncio.Event()
        msg = build_request(req, f"oai-{next(_IDS)}", self.model)

        async def requests():
            yield msg
            await done.wait()  # keep our side open until the answer is complete

        call = self._stub.ModelStreamInfer(requests())
        ended = False  # Triton has sent its last word: the call must not be cancelled then
        try:
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
            done.set()  # our side closes: Triton ends the call
            if not ended:
                # we left early (the HTTP client went away): Triton cancels the request. Only then:
                # Triton 2.51 can crash on a cancellation that reaches a call it has completed
                call.cancel()
