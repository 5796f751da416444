"""The LoRA control request's reading (triton/lora_control.py) and its thread: every malformed
request is a clear INVALID_ARG before the engine is asked anything; loads wait their turn."""
from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest

from specguide.request import InvalidRequestError, QueueFullError
from specguide.triton import lora_control
from specguide.triton.lora_control import Action, Control, LoRAControl, read_control


def _t(body) -> dict:
    text = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return {"specguide_lora": np.array([[text]], dtype=np.object_)}


def test_a_control_request_is_read_and_checked():
    assert read_control(_t({"action": "list"}), "trtllm", 8) == Control(Action.LIST)
    assert read_control(_t({"action": "load", "lora_name": "a", "lora_path": "b", "load_inplace": True}),
                        "unary", 8) == Control(Action.LOAD, "a", "b", True)
    assert read_control(_t(b'{"action": "unload", "lora_name": "a"}'), "trtllm", 8) == Control(Action.UNLOAD, "a")
    for tensors, iface, words in (
            (_t({"action": "list"}), "vllm", "goes to the engine model"),
            ({**_t({"action": "list"}), "text_input": np.array([["hi"]], dtype=np.object_)}, "trtllm",
             "no other input (got 'text_input')"),
            ({"specguide_lora": np.array([["{}"], ["{}"]], dtype=np.object_)}, "trtllm", "one JSON object (got 2"),
            (_t("x" * (lora_control.MAX_BYTES + 1)), "trtllm", "bytes; at most"),
            (_t("[" * 50 + "]" * 50), "trtllm", "nested 50 levels deep"),
            (_t("{"), "trtllm", "not valid JSON"),
            (_t([1]), "trtllm", "must be a JSON object"),
            (_t({"action": "drop"}), "trtllm", "action must be load, unload or list"),
            (_t({"action": "list", "x": 1}), "trtllm", "unknown key 'x'"),
            (_t({"action": "load", "lora_path": "b"}), "trtllm", "load needs a lora_name"),
            (_t({"action": "unload", "lora_name": 5}), "trtllm", "unload needs a lora_name"),
            (_t({"action": "load", "lora_name": "a"}), "trtllm", "load needs a lora_path"),
            (_t({"action": "unload", "lora_name": "a", "lora_path": "b"}), "trtllm", "lora_path is for load only"),
            (_t({"action": "list", "load_inplace": True}), "trtllm", "load_inplace is true or false, for load only"),
            (_t({"action": "load", "lora_name": "a", "lora_path": "b", "load_inplace": 1}), "trtllm", "load_inplace")):
        with pytest.raises(InvalidRequestError, match=re.escape(words)):
            read_control(tensors, iface, 8)


class _Engine:
    def __init__(self):
        self.gate = threading.Event()
        self.calls = []

    def load_adapter(self, name, path, replace):
        self.gate.wait(30)
        self.calls.append(("load", name, path, replace))
        return "/root/" + path

    def unload_adapter(self, name):
        self.calls.append(("unload", name))

    def adapters(self):
        return ["a"]


def test_controls_run_one_at_a_time_off_the_caller_and_a_full_queue_is_refused():
    engine = _Engine()
    ctl = LoRAControl(engine)
    answers, done = [], threading.Event()

    def answer(text, exc):
        answers.append((text, exc))
        if len(answers) == lora_control.MAX_WAITING + 1:
            done.set()

    ctl.submit(Control(Action.LOAD, "a", "p"), answer)  # taken by the thread; it waits on the gate
    while not engine.gate.is_set() and ctl._work.qsize():
        pass
    for _ in range(lora_control.MAX_WAITING):
        ctl.submit(Control(Action.LIST), answer)
    with pytest.raises(QueueFullError, match="LoRA control requests are waiting"):
        ctl.submit(Control(Action.LIST), answer)
    engine.gate.set()
    assert done.wait(30)
    assert answers[0] == (json.dumps({"lora_name": "a", "lora_path": "/root/p"}), None)
    assert all(a == (json.dumps({"adapters": ["a"]}), None) for a in answers[1:])
    with pytest.raises(InvalidRequestError, match="needs one instance of the model"):
        LoRAControl(engine, instances=2).submit(Control(Action.UNLOAD, "a"), answer)
