"""The response side's state of one Triton request (`Group`: its sender, its sequences still
running, FINAL sent once; a unary request's sequences merged into one response) and of each of
its engine sequences (`GroupMember`: response shaping, timings, metric counters). The Triton
module is passed in as `pb`, as in responses."""
from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from .interfaces import PROXY_ERROR
from .peer_metrics import Served
from .request_parser import ParsedRequest
from .responses import Payload, SequenceStream, merge_payloads, safe_send, to_response


class Group:
    """One Triton request: its sender and the sequences (rows x return sequences) still running.
    Sends FINAL once. A unary request (`specguide_unary`) gets one response with every sequence."""

    def __init__(self, pb: Any, request: Any, sender: Any, n: int, request_id: str = "", unary: bool = False,
                 via_proxy: bool = False):
        self.pb = pb  # triton_python_backend_utils
        self.request = request  # held until the group is done
        self.sender, self.remaining, self.closed = sender, n, False
        self.request_id, self.unary, self.via_proxy = request_id, unary, via_proxy
        self.parts: list[Optional[Payload]] = [None] * n  # unary: each sequence's final payload
        self.cancel_seen = False
        self.lock = threading.Lock()

    def deliver(self, index: int, payload: Payload) -> bool:
        """Send (or, unary, collect) one sequence's payload; True when that ended the request with an error."""
        if not self.unary:
            self.send(to_response(self.pb, payload), payload.finished)
            return False
        if payload.error is not None:
            return self.fail(to_response(self.pb, payload))
        if not payload.finished:
            return False
        with self.lock:
            self.parts[index] = payload
            done = all(p is not None for p in self.parts)
        if done:
            self.send(to_response(self.pb, merge_payloads(self.parts)), True, all_done=True)
        return False

    def send(self, response: Any, seq_finished: bool, all_done: bool = False) -> None:
        with self.lock:
            if self.closed:
                return
            if all_done:
                self.remaining = 0
            elif seq_finished:
                self.remaining -= 1
            final = seq_finished and self.remaining == 0
            self.closed = final
            safe_send(self.pb, self.sender, self._shaped(response), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            if final:
                self.request = None

    def fail(self, response: Any) -> bool:
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            safe_send(self.pb, self.sender, self._shaped(response), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            self.request = None
            return True

    def _shaped(self, response: Any) -> Any:
        return shaped(self.pb, response, self.via_proxy)


def shaped(pb: Any, response: Any, as_output: bool) -> Any:
    """An error to a proxy (or a client that asked) travels as the output PROXY_ERROR (see interfaces.PROXY_ERROR)."""
    if not as_output or response is None or not response.has_error():
        return response
    err = response.error()
    value = np.array([[err.code().name.encode(), err.message().encode()]], dtype=np.object_)
    return pb.InferenceResponse(output_tensors=[pb.Tensor(PROXY_ERROR, value)])


class GroupMember:
    """One engine sequence of a Group (one row's return sequence): its response shaping, timings
    and metric counters."""

    def __init__(self, group: Group, index: int, parsed: ParsedRequest, t_arrival: float, tokenizer: Any,
                 served: Served, n: int = 1):
        self.group, self.index, self.parsed = group, index, parsed
        self.served = served  # the vLLM / TensorRT-LLM series of the model its request came through
        self.n = n  # sequences of its prompt (num_return_sequences), counted once a prompt
        self.generated = 0  # tokens it has generated so far
        self.stream = SequenceStream(parsed, tokenizer)
        self.seq_id: Optional[int] = None
        self.t_arrival = t_arrival
        self.t_last: Optional[float] = None
        self.prompt_counted = False
        self.drafted = 0  # draft counters already added to the metrics
        self.accepted = 0
        self.cancel_sent = False
        self.done = False
