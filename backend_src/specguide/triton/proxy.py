"""BLS proxy: `specguide_unary` and `specguide_vllm` pass each request on to the `specguide` model.

One engine and one copy of the weights serve every name: this stub process holds no model (it
imports numpy and the Triton utilities only, ~40 MB). Each client request becomes one decoupled
BLS request to the engine model, on a thread of its own (BLS calls block), carrying:
- its input tensors (a batch dimension added for `specguide_vllm`, whose inputs are unbatched);
- the BLS parameter `specguide_interface` (`unary` | `vllm`): the engine model then parses and
  shapes responses the way this interface's clients expect (`request_parser`, `responses`);
- the client's own request parameters, as one JSON string.
Responses come back already shaped and are forwarded. A unary request gets the engine's one
merged response with FINAL. A client that cancels is noticed by a poll of `is_cancelled()`, and a
TensorRT-LLM stop request (`stop` = true, same request id) cancels its engine sequences.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .interfaces import ENGINE_MODEL, INTERFACE_PARAMETER, INTERFACES, PROXY_ERROR, SERVED_MODEL_PARAMETER, \
    SERVED_VERSION_PARAMETER
from .responses import safe_send

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
POLL_S = 0.05  # cancellation poll period
CLIENT_PARAMETERS = "specguide_client_parameters"  # = request_inputs.CLIENT_PARAMETERS; the proxy stays light


class _Live:
    """One client request in flight: its sender and the id of its BLS request.

    NOTE: once FINAL is sent, Triton frees the request's response factory, and `is_cancelled()`
    on its sender reads freed memory (the server segfaults): FINAL and the cancellation poll take
    `lock`, and the poll skips a request whose FINAL went out."""

    def __init__(self, sender: Any, bls_id: str):
        self.sender, self.bls_id = sender, bls_id
        self.cancel_sent = False
        self.closed = False
        self.lock = threading.Lock()

    def send(self, response: Any, flags: int) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = bool(flags & FINAL)
            safe_send(pb_utils, self.sender, response, flags, who="specguide proxy")

    def is_cancelled(self) -> bool:
        with self.lock:
            if self.closed:
                return False
            try:
                return bool(self.sender.is_cancelled())
            except Exception:
                return False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.kind = params["interface"]  # unary | vllm
        self.target = params.get("engine_model") or "specguide"
        self.served = {SERVED_MODEL_PARAMETER: args.get("model_name", ""),  # labels its traffic's metrics
                       SERVED_VERSION_PARAMETER: args.get("model_version", "1")}
        self.inputs = [i["name"] for i in config["input"]]
        self.passed_on = set(INTERFACES[ENGINE_MODEL].input_names)  # the rest (vLLM's image, ...) is refused
        self.add_batch_dim = int(config.get("max_batch_size", 0)) == 0  # the engine model batches
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        if self.decoupled != (self.kind == "vllm"):
            raise ValueError("specguide_vllm is decoupled, specguide_unary is not (config.pbtxt model_transaction_policy)")
        self._live: set[_Live] = set()
        self._threads: set[threading.Thread] = set()  # one per request in flight
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll, name=f"{self.kind}-cancel-poll", daemon=True)
        self._poller.start()

    def execute(self, requests: list) -> None:
        for request in requests:
            t = threading.Thread(target=self._run, args=(request,), daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()
        return None

    # ------------------------------------------------------------------ one request

    def _run(self, request: Any) -> None:
        sender = request.get_response_sender()
        live = _Live(sender, f"{request.request_id() or 'req'}.{uuid.uuid4().hex}")
        with self._lock:
            self._live.add(live)
        try:
            self._forward(request, live)
        except Exception as e:  # never leave a client without its FINAL
            live.send(_error(f"{type(e).__name__}: {e}"), FINAL)
        finally:
            with self._lock:
                self._live.discard(live)
                self._threads.discard(threading.current_thread())

    def _forward(self, request: Any, live: _Live) -> None:
        tensors = []
        for name in self.inputs:
            t = pb_utils.get_input_tensor_by_name(request, name)
            if t is not None and name not in self.passed_on:
                message = f"input '{name}' is not supported: this model generates text from text"
                prefix = "Error generating stream: " if self.kind == "vllm" else ""
                code = pb_utils.TritonError.UNSUPPORTED
                live.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(prefix + message, code)), FINAL)
                return
            if t is not None:
                arr = t.as_numpy()
                tensors.append(pb_utils.Tensor(name, arr[None] if self.add_batch_dim else arr))
        requested = list(request.requested_output_names())  # none = all (PROXY_ERROR included)
        bls = pb_utils.InferenceRequest(
            model_name=self.target,
            inputs=tensors,
            requested_output_names=requested + [PROXY_ERROR] if requested else [],
            request_id=live.bls_id,
            parameters={INTERFACE_PARAMETER: self.kind, CLIENT_PARAMETERS: request.parameters() or "{}", **self.served},
        )
        last = None
        for response in bls.exec(decoupled=True):
            if response.has_error():
                live.send(pb_utils.InferenceResponse(error=response.error()), FINAL)
                return
            outputs = response.output_tensors()
            if not outputs:  # the engine model's flag-only FINAL
                continue
            error = _proxy_error(outputs)
            if error is not None:
                live.send(pb_utils.InferenceResponse(error=error), FINAL)
                return
            if self.decoupled:
                live.send(pb_utils.InferenceResponse(output_tensors=outputs), 0)
            else:
                last = outputs
        if self.decoupled:
            live.send(None, FINAL)
        elif last is None:
            live.send(_error("the engine model sent no response"), FINAL)
        else:
            live.send(pb_utils.InferenceResponse(output_tensors=last), FINAL)

    # ------------------------------------------------------------------ cancellation

    def _poll(self) -> None:
        while not self._closing.wait(POLL_S):
            with self._lock:
                live = [x for x in self._live if not x.cancel_sent]
            for x in live:
                if x.is_cancelled():
                    x.cancel_sent = True
                    self._send_stop(x.bls_id)

    def _send_stop(self, bls_id: str) -> None:
        """TensorRT-LLM's stop request, which the engine model answers by cancelling that request."""
        try:
            stop = pb_utils.InferenceRequest(
                model_name=self.target,
                inputs=[pb_utils.Tensor("stop", np.array([[True]]))],
                requested_output_names=[],
                request_id=bls_id,
                parameters={INTERFACE_PARAMETER: self.kind},
            )
            for _ in stop.exec(decoupled=True):
                pass
        except Exception as e:
            pb_utils.Logger.log_warn(f"specguide proxy: could not cancel {bls_id}: {e}")

    def finalize(self) -> None:
        """Wait for the requests in flight (the engine model drains them), then for every thread.

        NOTE: a thread of ours still running while the stub tears its interpreter down segfaults it."""
        self._closing.set()
        deadline = time.monotonic() + 30.0
        self._poller.join(timeout=5.0)
        while time.monotonic() < deadline:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                break
            threads[0].join(timeout=max(0.0, deadline - time.monotonic()))


def _proxy_error(outputs: list) -> Any:
    """The engine model's error for this request (its output PROXY_ERROR: [code name, message]), or None."""
    for t in outputs:
        if t.name() == PROXY_ERROR:
            code, message = (v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
                             for v in t.as_numpy().reshape(-1)[:2])
            return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL))
    return None


def _error(message: str) -> Any:
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL))

