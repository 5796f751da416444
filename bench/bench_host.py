"""Host time per engine step, by phase (issue 78): a model whose forward costs next to nothing (the
real vocabulary and tokenizer, one layer of width 64: scripts/make_random_model.py's `host-probe`
shape, random weights), so that what a step costs is the host's work around the forward.

    python bench/bench_host.py [--batches 1,8,32,64] [--ks 0,3] [--modes unguided,guided]
                               [--steps 30] [--drafter draft_model] [--device cpu|cuda] [--json out.json]

Each configuration keeps `batch` requests in flight (a finished one is replaced at once: closed
loop), greedy, K fixed (adaptive and cost-aware K off, spec_max_rows 0), through an in-process
Engine whose callbacks do what the engine process does with each output: put it in an Outbox,
sent at the end of the step as one pickled message written to a pipe (read by a `cat` process).
Only steps with exactly `batch` decode rows and no prompt chunk are counted, `--steps` of them
after 5 warm-up steps. Guided requests carry a JSON schema with one free string (the budget
closing on); unguided ones ignore EOS. K=3 drafts with the draft model
(`--drafter`; the draft model is the target itself, so every draft is accepted and each row
verifies K + 1 positions).

Phases (exclusive time of the functions each names, ms per step):
  schedule  Scheduler.schedule (blocks, admission, chunks)
  propose   Proposer.plan (which rows draft, host drafts)
  stage     StepCore.key + stage (the step's inputs into its static buffers)
  drafting  the drafter's prepare / done (its own rows)
  forward   LlamaModel.forward and .logits (target and draft model: the device's work)
  kernels   the step's C scans of vocabulary-wide logits (greedy_verify, draft_pick, argmax, masks,
            non-finite checks): on the CPU the device's work, on a GPU kernels
  grammar   the grammar worker's callbacks (fetch, mask fill, draft advance, commit, staging)
  glue      the rest of the step body (contexts, copies, sampling: torch ops the host dispatches)
  wait      StepCore.finish (the host waiting for the device and the grammar commit)
  results   StepCore.results + Proposer.record (tokens back to host lists)
  outputs   OutputProcessor.append (tokens appended, stop checks; the text is made where the events are
            read, as the served engine process leaves it to its parent: text_stream.py)
  emit      OutputProcessor.emit and Outbox.flush (events built; the step's pickled and written to the pipe)
  other     the rest of EngineCore.step
host = every phase but forward, kernels and wait. Prints the CPU, then per configuration: ms per step by
phase (means), host ms per step (mean, share of the step, median step), tokens per step.
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(ROOT / "scripts"))

from machine import cpu_header  # noqa: E402  (bench/ is on sys.path when run as a script)

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PHASES = ("schedule", "propose", "stage", "drafting", "forward", "kernels", "grammar", "glue", "wait", "results",
          "outputs", "emit", "other")
DEVICE_PHASES = ("forward", "kernels", "wait")
KERNELS = ("greedy_verify", "draft_pick", "argmax", "nonfinite_rows", "mask_logits_rows", "mask_tiles")


class PhaseClock:
    """Exclusive time per phase: a wrapped function's time less that of wrapped functions it calls."""

    def __init__(self) -> None:
        self.stack: list[list] = []  # [phase, start, time of nested wrapped calls]
        self.step: dict[str, float] = defaultdict(float)
        self.thread = threading.get_ident()

    def wrap(self, owner, name: str, phase: str) -> None:
        fn = getattr(owner, name)
        if getattr(fn, "phase", None):  # wrapped already (an earlier engine)
            return
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != clock.thread:  # (another thread's call: not the step's)
                return fn(*args, **kwargs)
            frame = [phase, time.perf_counter(), 0.0]
            clock.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.stack.pop()
                spent = time.perf_counter() - frame[1]
                clock.step[phase] += spent - frame[2]
                if clock.stack:
                    clock.stack[-1][2] += spent
        timed.phase = phase
        setattr(owner, name, timed)


def probe_model(folder: Path) -> Path:
    from make_random_model import make
    from specguide.models.default_model import prepare_default_model
    import torch

    if not (folder / "model.safetensors").exists():
        make("host-probe", folder, prepare_default_model(), torch.float32, "cpu")
    return folder


def build_engine(model: Path, k: int, drafter: str, device: str, max_slots: int, flush=None):
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    return Engine(flush=flush, text=False, config=EngineConfig(  # as the engine process: the parent makes the text
        model_dir=str(model), device=device, max_slots=max_slots, max_seq_len=2048, num_draft_tokens=k,
        drafter=drafter if k else "ngram", draft_model_dir=str(model), adaptive_k=False, cost_aware_k=False,
        spec_max_rows=0, prefix_caching=False))


def instrument(engine, clock: PhaseClock) -> None:
    from specguide.engine.core import EngineCore
    from specguide.engine.output_processor import OutputProcessor
    from specguide.engine.scheduler import Scheduler
    from specguide.engine.step import StepCore
    from specguide.guided.grammar_worker import GrammarWorker
    from specguide.models.llama import LlamaModel
    from specguide.process.ipc import Outbox
    from specguide.speculative.proposer import Proposer

    for owner, names, phase in (
            (Scheduler, ("schedule",), "schedule"), (Proposer, ("plan",), "propose"),
            (StepCore, ("key", "stage"), "stage"), (LlamaModel, ("forward", "logits"), "forward"),
            (GrammarWorker, ("fetch", "fill_step", "draft_advance", "draft_end", "commit", "stage_host"), "grammar"),
            (StepCore, ("body",), "glue"), (StepCore, ("finish",), "wait"),
            (StepCore, ("results",), "results"), (Proposer, ("record",), "results"),
            (OutputProcessor, ("append",), "outputs"), (OutputProcessor, ("emit",), "emit"),
            (Outbox, ("flush",), "emit")):
        for name in names:
            clock.wrap(owner, name, phase)
    from specguide import kernels

    for name in KERNELS:  # (called as kernels.<name>: the package's attribute)
        clock.wrap(kernels, name, "kernels")
    for obj in _drafters(engine.core.proposer):
        for name in ("prepare", "done"):
            clock.wrap(type(obj), name, "drafting")
    clock.wrap(EngineCore, "step", "other")


def _drafters(proposer) -> list:
    """The in-step drafters the proposer holds (draft model, early exit, head)."""
    return [d for d in (proposer.head, proposer.early_exit, proposer.draft_model) if d is not None]


def measure(engine, clock: PhaseClock, batch: int, guided: bool, steps: int, outbox) -> dict:
    from specguide.request import GuidedDecodingParams, Request, SamplingParams

    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a long text as JSON."}])
    stop = threading.Event()
    lock = threading.Lock()
    live: set[int] = set()
    records: list[tuple[dict, int]] = []  # (phases, tokens appended)

    def submit() -> None:
        req = Request(prompt=prompt, params=SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=not guided),
                      guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)) if guided else None)
        with lock:
            if not stop.is_set():
                live.add(engine.submit(req, on_output))

    def on_output(o) -> None:
        with lock:
            outbox.put(0, o)  # what the engine process does
            if o.finished:
                live.discard(o.seq_id)
        if o.finished and not stop.is_set():
            threading.Thread(target=submit, daemon=True).start()  # (submit waits for the loop's inbox)

    core = engine.core
    original = core.step

    def step():
        clock.step = defaultdict(float)
        before = sum(len(s.output_ids) for s in core.scheduler.running.values())
        t0 = time.perf_counter()
        worked = original()
        outbox.flush()  # (the loop's own flush after the step then finds nothing)
        total = time.perf_counter() - t0
        prefills, decodes = core.last_step[:2] if worked else (0, 0)
        if worked and not prefills and decodes == batch:
            after = sum(len(s.output_ids) for s in core.scheduler.running.values())
            records.append(({**clock.step, "total": total}, after - before))
        return worked

    core.step = step
    try:
        for _ in range(batch):
            submit()
        deadline = time.monotonic() + 600
        while len(records) < steps + 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        with lock:
            stop.set()
            ids = list(live)
        for seq_id in ids:
            engine.cancel(seq_id)
        while engine.core.scheduler.has_work():
            time.sleep(0.05)
        del core.step
    rows = records[5: steps + 5]
    if not rows:
        return {"steps": 0}
    ms = {p: 1e3 * statistics.fmean(r[0].get(p, 0.0) for r in rows) for p in PHASES}
    total = 1e3 * statistics.fmean(r[0]["total"] for r in rows)
    host = sum(v for p, v in ms.items() if p not in DEVICE_PHASES)
    host_p50 = 1e3 * statistics.median(sum(v for p, v in r[0].items() if p in PHASES and p not in DEVICE_PHASES)
                                       for r in rows)  # (a step a collection or the machine stalled: out)
    tokens = statistics.fmean(r[1] for r in rows)  # (a finished row's tokens are not counted)
    return {"steps": len(rows), "ms": ms, "total_ms": total, "host_ms": host, "host_ms_p50": host_p50, "host_share": host / total,
            "tokens_per_step": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--ks", default="0,3")
    ap.add_argument("--modes", default="unguided,guided")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--drafter", default="draft_model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=str(Path(tempfile.gettempdir()) / "specguide-host-probe"))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(cpu_header(), flush=True)
    model = probe_model(Path(args.model))
    sink_proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    from specguide.process.ipc import Outbox, write_msg
    from specguide.util.heap import freeze_startup_heap

    outbox = Outbox(lambda msg: write_msg(sink_proc.stdin, msg))
    results = []
    clock = PhaseClock()
    for k in (int(x) for x in args.ks.split(",")):
        engine = build_engine(model, k, args.drafter, args.device, max(batches), outbox.flush)
        freeze_startup_heap()  # as the engine process does: a full collection walks only what came since
        clock.thread = engine._thread.ident  # the loop thread: the step's calls (grammar callbacks inline on CPU)
        instrument(engine, clock)
        try:
            for mode in args.modes.split(","):
                for batch in batches:
                    r = measure(engine, clock, batch, mode == "guided", args.steps, outbox)
                    r.update(batch=batch, k=k, mode=mode, device=args.device)
                    results.append(r)
                    if not r["steps"]:
                        print(f"K={k} {mode:8s} batch {batch:3d}: no step with the whole batch", flush=True)
                        continue
                    phases = " ".join(f"{p} {r['ms'][p]:.2f}" for p in PHASES if r["ms"][p] >= 0.005)
                    print(f"K={k} {mode:8s} batch {batch:3d}: step {r['total_ms']:.2f} ms, host {r['host_ms']:.2f} ms "
                          f"({100 * r['host_share']:.0f}%; median {r['host_ms_p50']:.2f}), {r['tokens_per_step']:.1f} tokens/step | "
                          f"{phases}",
                          flush=True)
        finally:
            engine.shutdown()
    sink_proc.stdin.close()
    sink_proc.wait()
    gc.unfreeze()  # (the grammar libraries' objects freed before exit, not reported as leaks)
    gc.collect()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
