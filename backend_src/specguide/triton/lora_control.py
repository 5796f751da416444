"""LoRA adapters loaded, unloaded and listed at run time through the engine model: a Triton request
to `specguide` (or `specguide_unary`) whose one input is `specguide_lora` (STRING [1]), a JSON object:

    {"action": "load", "lora_name": "support", "lora_path": "support-v2"}   # under lora_root
    {"action": "load", "lora_name": "support", "lora_path": "support-v3", "load_inplace": true}
    {"action": "unload", "lora_name": "support"}
    {"action": "list"}

answered by one response whose `text_output` is a JSON object (`{"lora_name", "lora_path"}` for a
load, `{"lora_name"}` for an unload, `{"adapters": [names]}` for a list), or by an error:
INVALID_ARG (refused: a path outside the adapter root, a name already served, an adapter the model
cannot use), NOT_FOUND (unloading a name not served). The OpenAI server's /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's bodies) send these; docs/lora.md.

The work (files read, an adapter checked against the model) runs on one thread of its own, not on
Triton's execute thread: other requests' intake never waits for a load."""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import numpy as np

from ..guided.limits import check_json_text
from ..request import InvalidRequestError, QueueFullError

LORA_INPUT = "specguide_lora"
MAX_BYTES = 1 << 14  # a control request's JSON (a name, a path and a few keys)
MAX_WAITING = 64  # control requests queued at once; more are refused (UNAVAILABLE)


class Action(Enum):
    LOAD = "load"
    UNLOAD = "unload"
    LIST = "list"


@dataclass(frozen=True)
class Control:
    """One control request, read and checked."""

    action: Action
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's: replace the adapter served under lora_name


def read_control(tensors: dict[str, np.ndarray], interface: str, max_depth: int) -> Control:
    """A request's `specguide_lora` input as a Control; InvalidRequestError naming what is wrong
    (other inputs beside it, a batch of several, not the JSON object above)."""
    if interface == "vllm":
        raise InvalidRequestError(f"{LORA_INPUT} goes to the engine model (specguide) or specguide_unary")
    others = sorted(set(tensors) - {LORA_INPUT})
    if others:
        raise InvalidRequestError(f"a {LORA_INPUT} request carries no other input (got {others[0]!r})")
    values = np.asarray(tensors[LORA_INPUT]).reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{LORA_INPUT} holds one JSON object (got {values.size} values)")
    raw = values[0]
    if len(raw) > MAX_BYTES:  # (bytes or str) before any parsing
        raise InvalidRequestError(f"{LORA_INPUT} has {len(raw)} bytes; at most {MAX_BYTES}")
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    obj = check_json_text(text, LORA_INPUT, max_depth)
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{LORA_INPUT} must be a JSON object: "
                                  f'{{"action": "load" | "unload" | "list", "lora_name", "lora_path"}}')
    extra = sorted(set(obj) - {"action", "lora_name", "lora_path", "load_inplace"})
    if extra:
        raise InvalidRequestError(f"{LORA_INPUT}: unknown key {extra[0]!r}")
    try:
        action = Action(obj.get("action"))
    except ValueError:
        raise InvalidRequestError(f"{LORA_INPUT}: action must be load, unload or list") from None
    name, path = obj.get("lora_name", ""), obj.get("lora_path", "")
    if action is not Action.LIST and not (isinstance(name, str) and name):
        raise InvalidRequestError(f"{LORA_INPUT}: {action.value} needs a lora_name")
    if action is Action.LOAD and not (isinstance(path, str) and path):
        raise InvalidRequestError(f"{LORA_INPUT}: load needs a lora_path")
    if action is not Action.LOAD and path:
        raise InvalidRequestError(f"{LORA_INPUT}: lora_path is for load only")
    inplace = obj.get("load_inplace", False)
    if not isinstance(inplace, bool) or inplace and action is not Action.LOAD:
        raise InvalidRequestError(f"{LORA_INPUT}: load_inplace is true or false, for load only")
    return Control(action, name if isinstance(name, str) else "", path if isinstance(path, str) else "", inplace)


class LoRAControl:
    """Runs control requests on the engine (an EngineProcess), one at a time on a thread of its own;
    `answer(text or None, error or None)` is called with each outcome. `instances` > 1: loads and
    unloads are refused (each instance has an engine of its own, and a request reaches one)."""

    def __init__(self, engine: Any, instances: int = 1):
        self.engine, self.instances = engine, instances
        self._work: "queue.Queue[tuple[Control, Callable[[Optional[str], Optional[BaseException]], None]]]" = \
            queue.Queue(MAX_WAITING)
        self._thread = threading.Thread(target=self._run, name="specguide-lora-control", daemon=True)
        self._thread.start()

    def submit(self, control: Control, answer: Callable[[Optional[str], Optional[BaseException]], None]) -> None:
        """Queue `control`; QueueFullError when MAX_WAITING wait already."""
        if control.action is not Action.LIST and self.instances > 1:
            raise InvalidRequestError(f"loading or unloading LoRA adapters at run time needs one instance of the "
                                      f"model (instance_group count 1; this model has {self.instances}): name "
                                      f"the adapters in multi_lora.json or lora_adapters instead")
        try:
            self._work.put_nowait((control, answer))
        except queue.Full:
            raise QueueFullError(f"{MAX_WAITING} LoRA control requests are waiting; retry later") from None

    def _run(self) -> None:
        while True:
            control, answer = self._work.get()
            try:
                text = json.dumps(self._do(control))
            except Exception as exc:
                answer(None, exc)
            else:
                answer(text, None)

    def _do(self, c: Control) -> dict[str, Any]:
        if c.action is Action.LOAD:
            folder = self.engine.load_adapter(c.lora_name, c.lora_path, c.load_inplace)
            return {"lora_name": c.lora_name, "lora_path": folder}
        if c.action is Action.UNLOAD:
            self.engine.unload_adapter(c.lora_name)
            return {"lora_name": c.lora_name}
        return {"adapters": self.engine.adapters()}
