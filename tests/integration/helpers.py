"""Helpers shared by the integration tests: raw tensors, one request on a fresh gRPC stream."""
from __future__ import annotations

import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from .conftest import MODEL


def S(*vals):
    return np.array([[v.encode() for v in vals]], dtype=np.object_)


def I(v, dtype=np.int32):
    return np.array([[v]], dtype=dtype)


def B(v: bool):
    return np.array([[v]], dtype=np.bool_)


def tensor_inputs(values: dict[str, np.ndarray]) -> list:
    """gRPC input tensors from arrays, shapes and dtypes as given (client.common.grpc_inputs converts
    values to the declared types instead; tests of bad input need them raw)."""
    out = []
    for name, arr in values.items():
        t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def raw_stream(server, inputs: dict[str, np.ndarray], timeout: float = 120.0, cancel_after: int = 0,
               model: str = MODEL):
    """Send one request to `model` on a fresh gRPC stream; return [(result, error, final)] up to the final one."""
    client = grpcclient.InferenceServerClient(server.grpc)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, tensor_inputs(inputs), enable_empty_final_response=True)
    got = []
    try:
        while True:
            result, error = q.get(timeout=timeout)
            final = error is not None or result.get_response().parameters["triton_final_response"].bool_param
            got.append((result, error, final))
            if final or (cancel_after and len(got) >= cancel_after):
                return got
    finally:
        client.stop_stream(cancel_requests=bool(cancel_after))
        client.close()
