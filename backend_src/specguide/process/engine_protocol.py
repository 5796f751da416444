"""What the engine process and its parent (EngineProcess, engine_process.py) tell each other.

The child's side is engine_process_child.py (its command line names it, so tools and tests find the
engine process by "engine_process"). Messages are length-prefixed pickles over the child's stdin
/ stdout (compile_worker's framing, ipc.py).
Parent -> child: the EngineConfig, then ("submit", key, Request) | ("cancel", key) |
("call", key, method, args) | ("shutdown", drain, timeout). Child -> parent: ("ready", EngineInfo) |
("failed", text), then ("outs", [(key, RequestOutput), ...]) (a loop turn's events) |
("refused", key, exception) | ("submitted", key) | ("reply", key, value) | ("stats", dict) |
("dead", text). A call is one of the Engine's CALLS.
`key` is the parent's id for a request: the seq_id `submit` returns and outputs carry.

Also here: the settings both sides read (the environment's names, the stats' periods, the exit
code of a dead loop thread) and `describe_exit`, an engine process's end in words."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable, Optional

from ..config import EngineConfig
from ..request import RequestOutput

Callback = Callable[[RequestOutput], None]

STATS_S = 0.05  # how often the engine process sends its stats while they change (and checks its loop thread)
STATS_IDLE_S = 0.5  # its period while they do not (an idle engine): unchanged stats are not sent again
EXIT_LOOP_DIED = 3  # the engine process's exit code when its loop thread died
CALLS = frozenset({"load_adapter", "unload_adapter", "adapters"})  # Engine methods the parent may call
PARENT_ENV = "SPECGUIDE_ENGINE_PARENT"
SERVER_ENV = "SPECGUIDE_ENGINE_SERVER"  # the server (ipc.process_identity) whose end ends the stub and engine


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once loaded."""

    pid: int
    config: EngineConfig  # as the engine resolved it (slots sized, ...)
    model_dir: str  # the model folder (its tokenizer)
    drafter: str
    head: bool  # a trained draft head is in use
    probes: dict  # tokenizer.PROBES through the engine's tokenizer (the stub's light one must agree)
    warmup_s: float
    awaited_head: str = ""  # the draft head file the engine attaches once written ("" = none awaited)
    frozen_objects: int = 0  # its start-up heap, frozen out of full collections (util/heap.py)


def describe_exit(returncode: Optional[int], dead_message: str = "") -> str:
    """Why the engine process ended, in words for clients and the log."""
    if dead_message:
        return dead_message
    if returncode is None:
        return "the engine process stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = " (the kernel's OOM killer sends it when memory runs out)" if name == "SIGKILL" else ""
        return f"the engine process was killed by {name}{why}"
    return f"the engine process exited with code {returncode}"
