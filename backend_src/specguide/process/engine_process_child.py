"""The engine process's own side (`child_main`): load the Engine, report it (EngineInfo), then
serve the parent's messages (engine_protocol.py: the protocol; engine_process.py: the parent's
side) until shutdown; its stats go up every STATS_S while they change, and its loop thread's death
ends the process (EXIT_LOOP_DIED); the server's end (SERVER_ENV) ends the parent stub and the process."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from .engine_protocol import CALLS, EXIT_LOOP_DIED, PARENT_ENV, SERVER_ENV, STATS_IDLE_S, STATS_S, Callback, EngineInfo
from ..util.heap import freeze_startup_heap
from ..util.stalls import watch_collections
from .ipc import Outbox, die_with_parent, read_msg, renice, wait_until_gone, write_msg
from ..request import RequestOutput


def child_main() -> None:
    """The engine process: load the engine, then serve the parent's messages until shutdown."""
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # messages; stray prints from libraries go to stderr instead
    os.dup2(2, 1)
    die_with_parent(PARENT_ENV)
    # NOTE: a terminal's Ctrl-C (`make serve`) reaches the whole process group, this process too: the
    # server shuts the engine down itself as it unloads the model. Taken here, the SIGINT killed the
    # engine first and its stub restarted it in the middle of the shutdown ("crash 1 in a row").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # the watchdog (engine_process.py) asks a stuck engine where its threads are before killing it
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="specguide engine: %(levelname)s %(message)s")
    if os.environ.get(SERVER_ENV):
        threading.Thread(target=_end_with_server, args=(os.environ[SERVER_ENV],), name="specguide-server-watch",
                         daemon=True).start()
    write_lock = threading.Lock()

    def send(msg: object) -> None:
        with write_lock:
            write_msg(out, msg)

    outbox = Outbox(send)  # the events of a loop turn, sent as one message
    config = read_msg(inp)
    renice(config.engine_nice)  # before the engine's threads start (they inherit it)
    try:
        from ..engine import faults
        from ..engine.loop import Engine

        engine = Engine(config, flush=outbox.flush, text=False)  # the parent makes the text
        core = engine.core
        if faults.enabled():  # reliability tests: each request may name a fault
            faults.FaultInjector(core).install()
        core.compiler.lanes.start()  # compile worker processes warm before the first big guide
    except Exception as e:
        logging.exception("the engine failed to load")
        send(("failed", f"{type(e).__name__}: {e}"))
        os._exit(2)
    from ..tokenizer import probe

    frozen = freeze_startup_heap()  # the model, torch, transformers: never walked by a collection again
    watch_collections()
    send(("ready", EngineInfo(os.getpid(), core.config, str(core.model_dir), core.drafter,
                              core.head_drafter is not None, probe(core.tokenizer), core.warmup_s,
                              str(core.proposer.head_path) if core.proposer.awaits_head else "", frozen)))
    seq_of: dict[int, int] = {}  # parent key -> engine seq_id, while the request runs
    seq_lock = threading.Lock()

    def callback(key: int) -> Callback:
        def on_output(o: RequestOutput) -> None:
            if o.finished:
                with seq_lock:
                    seq_of.pop(key, None)
            outbox.put(key, o)
        return on_output

    def watch() -> None:  # stats for the metrics; the loop thread's death ends the process
        last, period = None, STATS_S
        while True:
            time.sleep(period)
            if not engine.is_alive():
                engine.join()  # its dying words (every request's error) are sent first
                send(("dead", f"the engine loop failed ({type(engine.failure).__name__}; the server log has "
                              f"the traceback)"))
                out.flush()
                os._exit(EXIT_LOOP_DIED)
            stats = engine.stats()
            # unchanged stats (an idle engine) are not sent again, and looked at less often: new work
            # shows in the gauges within STATS_IDLE_S, then every STATS_S while anything changes
            if stats == last:
                period = STATS_IDLE_S
                continue
            period = STATS_S
            try:
                send(("stats", stats))
            except Exception:
                os._exit(0)  # the parent is gone
            last = stats

    threading.Thread(target=watch, name="specguide-engine-watch", daemon=True).start()
    while True:
        msg = read_msg(inp)
        if msg is None:  # the parent is gone
            os._exit(0)
        kind = msg[0]
        if kind == "submit":
            _, key, request = msg
            try:
                with seq_lock:  # NOTE: the engine calls callbacks outside its own lock: no deadlock
                    seq_of[key] = engine.submit(request, callback(key))
            except Exception as e:
                send(("refused", key, e))
            else:
                send(("submitted", key))
        elif kind == "call":  # a control call (CALLS), on a thread of its own: it may read files
            threading.Thread(target=_call, args=(engine, send) + tuple(msg[1:]), name="specguide-engine-call",
                             daemon=True).start()
        elif kind in ("cancel", "stop"):  # "stop": the parent found a stop string in the text
            with seq_lock:
                seq_id = seq_of.get(msg[1])
            if seq_id is not None:
                (engine.cancel if kind == "cancel" else engine.stop)(seq_id)
        elif kind == "shutdown":
            engine.shutdown(drain=msg[1], timeout=msg[2])
            out.flush()
            os._exit(0)


def _call(engine, send, key: int, method: str, args: tuple) -> None:
    if method not in CALLS:
        send(("refused", key, ValueError(f"unknown engine call {method!r}")))
        return
    try:
        value = getattr(engine, method)(*args)
    except Exception as e:
        send(("refused", key, e))
    else:
        send(("reply", key, value))


def _end_with_server(server: str) -> None:
    """When the server process ends, SIGKILL the parent stub, then end this process (its compile
    workers die with it). NOTE: Triton 2.51's stub, once its server is gone, never finishes exiting:
    every thread of it waits on a futex (its response thread inside a metric call that awaits the dead
    server's reply), so without this the stub, this engine and its workers would stay for good."""
    wait_until_gone(server)
    parent = int(os.environ.get(PARENT_ENV, "0"))
    logging.error("the server process (pid %s) is gone: ending its stub (pid %d) and this engine",
                  server.split(":", 1)[0], parent)
    if parent and os.getppid() == parent:
        os.kill(parent, signal.SIGKILL)
    os._exit(0)
