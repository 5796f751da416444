"""TritonPythonModel: decoupled requests in, engine sequences, streamed responses out.

Threads:
- Triton's execute thread reads each request (request_inputs.py), maps it to engine requests
  (request_parser.py), submits its rows to the engine and returns at once. A bad request gets one
  error response + FINAL and touches nothing else.
- The engine loop thread calls `_on_output` once per step per sequence; it only enqueues.
- The response thread builds and sends responses, records metrics, and every few
  milliseconds checks cancellation (`response_sender.is_cancelled()`), engine health and the
  slot / queue gauges. A cancelled request is cancelled in the engine at once, so its slot is
  free at the next step; so is one whose stop request reached another instance (stop_board.py).
  Each request's and sequence's response state: triton/groups.py.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import json
import os
import queue
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ..config import EngineConfig, lora_file
from ..util import stalls
from ..util.memory import trim
from ..request import CLIENT_ERRORS, EngineDeadError, RequestOutput, error_code, task_name
from .instance import instance_count
from . import request_parser
from .groups import Group, GroupMember, shaped
from .instance import Instance
from .interfaces import INTERFACES, SERVED_MODEL_PARAMETER, SERVED_VERSION_PARAMETER
from .input_limits import BIG_REQUEST_BYTES, InputLimits, model_vocab_size, request_bytes
from .lora_control import LORA_INPUT, LoRAControl, read_control
from .metrics import Metrics
from .peer_metrics import PeerMetrics, Served
from .request_inputs import interface_of, is_stop_request, read_parameters, read_tensors, wants_error_output
from .responses import VLLM_ERROR_PREFIX, Payload, error_response, safe_send
from .stop_board import StopBoard

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WAKE_S = 0.02  # the response thread wakes at least this often
POLL_S = 0.05  # cancellation / engine health / gauge poll period
_STOP = object()


UNEXPECTED = "could not read the request (an internal error; the server log has the details)"


def _message(exc: BaseException, interface: str) -> str:
    """A client's message: ours as written; never a Python exception's own text (that is logged)."""
    if not isinstance(exc, CLIENT_ERRORS):
        where = "".join(traceback.format_tb(exc.__traceback__))
        pb_utils.Logger.log_error(f"specguide: unexpected error reading a request: {type(exc).__name__}: {exc}\n{where}")
    text = str(exc) if isinstance(exc, CLIENT_ERRORS) else UNEXPECTED
    return (VLLM_ERROR_PREFIX if interface == "vllm" else "") + text


def _log(level: str, text: str) -> None:
    {"info": pb_utils.Logger.log_info, "warn": pb_utils.Logger.log_warn}.get(level, pb_utils.Logger.log_error)(text)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        """Load and warm up the engine. Only the `specguide` model (interfaces.ENGINE_MODEL) runs this."""
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("specguide needs `model_transaction_policy { decoupled: true }`")
        from ..process.engine_process import EngineProcess  # the engine runs (and is restarted) in a process of its own

        self.model_name, self.model_version = args.get("model_name", "specguide"), str(args.get("model_version", "1"))
        # each instance (instance_group) is a stub with an engine of its own, on the instance's device
        self.instance = Instance.from_args(args, self.model_name)
        config = EngineConfig.from_parameters(model_config.get("parameters", {}))
        config = dataclasses.replace(config, lora_adapters=lora_file(
            config.lora_adapters, Path(args.get("model_repository", ".")), self.model_version))
        config = dataclasses.replace(config, device=self.instance.engine_device(config.device))
        self.engine = EngineProcess(config, log=_log, server_pid=os.getppid())  # the stub's parent: tritonserver
        self.config = self.engine.config  # as the engine resolved it (slots sized to memory, ...)
        self.tokenizer = self.engine.tokenizer
        # input caps, checked before any work; every token id against the model's vocabulary (its
        # config.json, as the engine reads it: an id past it must never reach a step)
        self.limits = InputLimits.from_config(self.config, model_vocab_size(self.engine.info.model_dir))
        self.metrics = Metrics(pb_utils, self.model_name, self.model_version, self.instance.label)
        # the vLLM and TensorRT-LLM backends' families, per served model (the proxies' names up front)
        self._served_default = {i.kind: name for name, i in INTERFACES.items() if i.kind != "engine"}
        several = instance_count(model_config) > 1  # then the engine-state gauges are per instance
        self.peer_metrics = PeerMetrics(pb_utils, self.model_name, self.model_version, self.config.max_seq_len,
                                        served=tuple((name, "1") for name in self._served_default.values()),
                                        instance=self.instance.label if several else "")
        # with several instances a stop request may reach one that does not run the request
        self._stops = StopBoard(self.model_name, os.getppid()) if several else None
        self._lora = LoRAControl(self.engine, instance_count(model_config))  # run-time adapter loads
        self._outbox: "queue.Queue[Any]" = queue.Queue()
        self._live: set[GroupMember] = set()
        self._live_lock = threading.Lock()
        self._groups = itertools.count(1)  # Request.group: one per Triton request (its rows share slots fairly)
        self._closing = False
        stalls.watch_collections()
        self._thread = threading.Thread(target=self._response_loop, name="specguide-responses", daemon=True)
        self._thread.start()
        self._restarts = 0  # engine restarts already counted in the metrics
        head = " with the trained draft head" if self.engine.head_drafter else ""
        pb_utils.Logger.log_info(f"specguide: engine ready, drafter {self.engine.drafter}{head}, "
                                 f"warmed up in {self.engine.warmup_s:.2f} s (instance {self.instance.label}, "
                                 f"engine process {self.engine.pid}, start-up heap of "
                                 f"{self.engine.frozen_objects} objects frozen; {self.config})")

    # ------------------------------------------------------------------ execute thread

    def execute(self, requests: list) -> None:
        for request in requests:
            t0 = time.perf_counter()
            self._handle(request)
            stalls.report("request intake (Triton's execute thread)", time.perf_counter() - t0, "",
                          pb_utils.Logger.log_warn)
        return None

    def _handle(self, request: Any) -> None:
        t_arrival = time.perf_counter()
        sender = request.get_response_sender()
        interface = "trtllm"
        tensors: dict = {}
        error_output = False
        try:
            parameters = read_parameters(request, self.limits)
            error_output = wants_error_output(parameters)
            interface = interface_of(parameters)
            tensors = read_tensors(pb_utils, request)
            if LORA_INPUT in tensors:
                self._lora_control(sender, tensors, interface, error_output)
                return
            if is_stop_request(tensors):
                self._stop(request.request_id())
                safe_send(pb_utils, sender, None, FINAL)
                return
            if self._closing:
                raise EngineDeadError("the model is shutting down")
            if not self.engine.is_alive():
                raise EngineDeadError(self.engine.down_reason() or "the engine is not running")
            parsed = request_parser.parse_request(
                tensors,
                parameters,
                default_max_tokens=self.config.default_max_tokens,
                max_tokens_limit=self.config.max_tokens_limit,
                tokenizer=self.tokenizer,
                request_id=request.request_id(),
                limits=self.limits,
            )
        except Exception as exc:
            self._reject(sender, exc, interface, error_output)
            return
        finally:
            if tensors and request_bytes(tensors) > BIG_REQUEST_BYTES:
                tensors = {}
                trim(force=False)  # give a big request's freed heap back to the OS
        key = next(self._groups)
        for p in parsed:
            p.request.group = key
        group = Group(pb_utils, request, sender, len(parsed), request.request_id(), unary=interface == "unary",
                       via_proxy=interface != "trtllm" or error_output)
        served = self._served(parameters, interface)
        per_row = Counter(p.batch_index for p in parsed)  # a prompt's num_return_sequences
        seqs = [GroupMember(group, i, p, t_arrival, self.tokenizer, served, per_row[p.batch_index])
                for i, p in enumerate(parsed)]
        with self._live_lock:
            self._live.update(seqs)
        try:
            for seq in seqs:
                seq.seq_id = self.engine.submit(seq.parsed.request, lambda out, seq=seq: self._on_output(seq, out))
        except Exception as exc:  # e.g. prompt too long, queue full: the whole request fails
            for seq in seqs:
                seq.done = True
                if seq.seq_id is not None:
                    self.engine.cancel(seq.seq_id)  # its final event is swallowed: the group is closed
            if group.fail(error_response(pb_utils, _message(exc, interface), error_code(exc))):
                self.metrics.finished("rejected")
            with self._live_lock:
                self._live.difference_update(seqs)

    def _lora_control(self, sender: Any, tensors: dict, interface: str, error_output: bool) -> None:
        """A LoRA control request (triton/lora_control.py): answered from the control thread."""
        control = read_control(tensors, interface, self.limits.max_json_depth)

        def answer(text: Any, exc: Any) -> None:
            if exc is not None:
                response = error_response(pb_utils, _message(exc, "trtllm"), error_code(exc))
                safe_send(pb_utils, sender, shaped(pb_utils, response, error_output), FINAL)
                return
            out = pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_))
            safe_send(pb_utils, sender, pb_utils.InferenceResponse(output_tensors=[out]), FINAL)

        self._lora.submit(control, answer)

    def _served(self, parameters: dict, interface: str) -> Served:
        """The metric series of the model the request came through: a proxy names itself (BLS
        parameters); a direct request came to this model."""
        if interface == "trtllm":
            return self.peer_metrics.served(self.model_name, self.model_version)
        name = str(parameters.get(SERVED_MODEL_PARAMETER) or self._served_default.get(interface, self.model_name))
        return self.peer_metrics.served(name, str(parameters.get(SERVED_VERSION_PARAMETER) or "1"))

    def _reject(self, sender: Any, exc: Exception, interface: str, error_output: bool = False) -> None:
        response = error_response(pb_utils, _message(exc, interface), error_code(exc))
        safe_send(pb_utils, sender, shaped(pb_utils, response, error_output), FINAL)
        self.metrics.finished("rejected")

    def _stop(self, request_id: str) -> None:
        """TensorRT-LLM's stop signal (and the proxies' cancellation): cancel that request's sequences;
        one this instance does not hold goes on the stop board, for the instance that does."""
        with self._live_lock:
            seqs = [s for s in self._live if request_id and s.group.request_id == request_id]
        if not seqs and request_id and self._stops is not None:
            self._stops.post(request_id)
        for seq in seqs:
            if seq.seq_id is not None and not seq.cancel_sent:
                seq.cancel_sent = True
                self.engine.cancel(seq.seq_id)

    # ------------------------------------------------------------------ engine loop thread

    def _on_output(self, seq: GroupMember, out: RequestOutput) -> None:
        self._outbox.put((seq, out, time.perf_counter()))

    # ------------------------------------------------------------------ response thread

    def _response_loop(self) -> None:
        next_poll = 0.0
        while True:
            try:
                item = self._outbox.get(timeout=WAKE_S if self._live else POLL_S)  # idle: the poll's period
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:
                t0 = time.perf_counter()
                if item is not None:
                    stalls.report("wait of an engine output in the stub's queue", t0 - item[2], "",
                                  pb_utils.Logger.log_warn)
                    self._deliver(*item)
                    made = item[1].last_token_time_ns  # the engine appended its newest token then (wall clock)
                    if item[1].token_ids and made:
                        stalls.report("time from an engine token to its response's send", (time.time_ns() - made) / 1e9,
                                      "", pb_utils.Logger.log_warn)
                now = time.perf_counter()
                if now >= next_poll:
                    next_poll = now + POLL_S
                    self._poll()
                stalls.report("response thread turn", time.perf_counter() - t0,
                              f"delivering {now - t0:.2f} s, then polling", pb_utils.Logger.log_warn)
            except Exception as e:  # never let the response thread die
                pb_utils.Logger.log_error(f"specguide: response thread: {e!r}")

    def _deliver(self, seq: GroupMember, out: RequestOutput, t: float) -> None:
        if seq.done:
            return
        if seq.seq_id is None:
            seq.seq_id = out.seq_id
        m, peer = self.metrics, seq.served
        if out.token_ids:
            if not seq.prompt_counted:
                peer.first_token(out.num_input_tokens, t - seq.t_arrival)
                m.prompt_tokens.increment(out.num_input_tokens)
                if self.config.prefix_caching:
                    m.prefix_query_tokens.increment(out.num_input_tokens)
                    m.prefix_hit_tokens.increment(out.num_cached_tokens)
                seq.prompt_counted = True
            m.generation_tokens.increment(len(out.token_ids))
            peer.tokens(len(out.token_ids), None if seq.t_last is None else t - seq.t_last)
            seq.generated += len(out.token_ids)
            if not out.first_token:  # a decode step (the first token comes from the prefill)
                m.tokens_per_step.observe(len(out.token_ids))
            if seq.t_last is None:
                m.ttft.observe(t - seq.t_arrival)
            else:
                m.tpot.observe((t - seq.t_last) / len(out.token_ids))
            seq.t_last = t
        drafted, accepted = out.total_draft_tokens, out.total_accepted_draft_tokens
        if drafted > seq.drafted:
            m.draft_tokens.increment(drafted - seq.drafted)
            seq.drafted = drafted
        if accepted > seq.accepted:
            m.accepted_tokens.increment(accepted - seq.accepted)
            seq.accepted = accepted
        try:
            payload = seq.stream.on_output(out)
        except Exception as e:  # a response that cannot be built fails its request, nothing else
            pb_utils.Logger.log_error(f"specguide: building a response: {e!r}")
            payload = Payload(error=f"could not build the response: {e}", error_code="INTERNAL", finished=True)
            if not out.finished and seq.seq_id is not None:
                self.engine.cancel(seq.seq_id)
            out = RequestOutput(seq_id=out.seq_id, finished=True, finish_reason="error", error=payload.error)
        if out.finished:  # recorded before the last response goes: a client that has it sees it counted
            m.latency.observe(t - seq.t_arrival)
            peer.finished(out.num_input_tokens or len(seq.parsed.request.prompt_ids or ()), seq.generated,
                          t - seq.t_arrival)
            if seq.parsed.sequence_index == 0:
                peer.row(seq.n)
            m.finished(out.finish_reason or "error")
            req = seq.parsed.request
            adapter = req.lora_name or (task_name(req.lora_task_id) if req.lora_task_id is not None else None)
            if adapter is not None and out.error is None:
                m.adapter_finished(adapter, seq.generated)
            if out.finish_reason == "cancelled":
                m.cancelled(out.stage or "")
        if payload is not None and seq.group.deliver(seq.index, payload):
            self._cancel_siblings(seq)
        if out.finished:
            seq.done = True
            with self._live_lock:
                self._live.discard(seq)
        elif seq.parsed.stream:
            self._check_cancel(seq)

    def _cancel_siblings(self, seq: GroupMember) -> None:
        """A unary request failed in one sequence: its answer is sent, the other sequences stop."""
        with self._live_lock:
            others = [s for s in self._live if s.group is seq.group and s is not seq]
        for s in others:
            s.done = True
            if s.seq_id is not None:
                self.engine.cancel(s.seq_id)
            with self._live_lock:
                self._live.discard(s)

    def _check_cancel(self, seq: GroupMember) -> None:
        if seq.cancel_sent or seq.seq_id is None:
            return
        g = seq.group
        if not g.cancel_seen:
            with g.lock:  # NOTE: never ask a sender that sent FINAL: its response factory is freed (segfault)
                if g.closed:
                    return
                try:
                    g.cancel_seen = bool(g.sender.is_cancelled())
                except Exception:
                    return
        if g.cancel_seen:
            seq.cancel_sent = True
            self.engine.cancel(seq.seq_id)

    def is_ready(self) -> bool:
        """Whether new requests can be served: the engine runs and the model is not unloading.

        Triton's Python backend asks a model's `is_ready()` for its readiness from r26.03 on
        (python_backend PR #430: pb_stub.cc calls it when the model defines it); the 2.51 server
        of the `nvidia-pytriton` wheel and the 24.10 image of our Dockerfile do not, so there the engine's state shows as
        `specguide_engine_alive` and a 1-token inference probe (docker/kubernetes.yaml) fails while
        the engine restarts."""
        return not self._closing and self.engine.is_alive()

    def _poll(self) -> None:
        with self._live_lock:
            live = list(self._live)
        for seq in live:
            self._check_cancel(seq)
        if self._stops is not None:  # stops other instances posted for requests of this one
            for request_id in self._stops.take({s.group.request_id for s in live if s.seq_id is not None}):
                self._stop(request_id)
        stats = self.engine.stats()
        self.metrics.engine_stats(stats)
        self.peer_metrics.engine_stats(stats)
        restarts = int(stats.get("restarts", 0))
        if restarts > self._restarts:
            self.metrics.engine_restarts.increment(restarts - self._restarts)
            self._restarts = restarts
        if live and not self.engine.is_alive() and self._outbox.empty():
            # a backstop: the engine's death fails its requests itself, and those errors went out first
            self._fail_all(self.engine.down_reason() or "the engine stopped; see the server log")

    def _fail_all(self, message: str) -> None:
        with self._live_lock:
            live, self._live = list(self._live), set()
        for seq in live:
            seq.done = True
            if seq.group.fail(error_response(pb_utils, message, EngineDeadError.code)):
                self.metrics.finished("error")

    # ------------------------------------------------------------------ shutdown

    def finalize(self) -> None:
        self._closing = True
        try:
            self.engine.shutdown(drain=True, timeout=self.config.drain_timeout_s)
        except Exception as e:
            pb_utils.Logger.log_error(f"specguide: engine shutdown: {e!r}")
        self._outbox.put(_STOP)  # after every final event the engine delivered
        self._thread.join(timeout=10.0)
        self._fail_all("the model was unloaded")
        if self._stops is not None:
            self._stops.close()
        # NOTE: the Python backend deletes a metric (family) in the server when its Python object dies,
        # and the stub's own teardown comes after the server stopped listening to it: without this,
        # an unloaded model's series stayed exported with their last values, and every load added
        # another set of metric objects to tritonserver (test_model_control_server)
        self.metrics = self.peer_metrics = None
        gc.collect()
