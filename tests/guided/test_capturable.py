"""Capturable guided decoding on CPU: hostfunc streams and registry, the CapturableGuidedDecoder
and its GuidedStepper against the plain GuidedDecoder (same masks, limits and matcher states),
and the real SmolLM2 engine with the worker-thread (and inline) executor giving exactly the plain
decoder's tokens on a mixed batch of guided (JSON schema, regex, EBNF) and unguided requests, with and without
speculation (n-gram and early-exit drafters)."""
from __future__ import annotations

import dataclasses

import threading

import pytest
import torch

from specguide.config import EngineConfig
from specguide.cuda import hostfunc
from specguide.cuda.graphs import StepGraphs
from specguide.cuda.hostfunc import HostFuncError, InlineStream, WorkerStream
from specguide.engine.loop import Engine
from specguide.guided import GuidedDecoder
from specguide.guided.capturable import CapturableGuidedDecoder
from specguide.guided.grammar_worker import NO_LIMIT, GuidedStep
from specguide.request import Request, SamplingParams
from specguide.engine.step_layout import Drafting

from .conftest import VOCAB
from .helpers import load_guided_samples

# ---- hostfunc ---------------------------------------------------------------------------------


def test_inline_stream_runs_at_once_and_raises_at_launch():
    seen = []
    s = InlineStream()
    s.launch(seen.append, 1)
    assert seen == [1] and s.record().query()
    def boom():
        raise ValueError("boom")
    with pytest.raises(HostFuncError, match="boom"):
        s.launch(boom)


def test_worker_stream_runs_callbacks_in_order_on_another_thread():
    s = WorkerStream(delay_s=0.0005)
    seen = []
    try:
        for i in range(40):
            s.launch(lambda i=i: seen.append((i, threading.get_ident())))
        ev = s.record()
        ev.synchronize(timeout=30)
        assert [i for i, _ in seen] == list(range(40))
        assert {t for _, t in seen} == {s.thread.ident} != {threading.get_ident()}
    finally:
        s.close()
    assert not s.thread.is_alive()


def test_worker_stream_surfaces_callback_exceptions():
    s = WorkerStream()
    after = []
    try:
        def bad():
            raise ValueError("bad grammar state")
        s.launch(bad)
        s.launch(after.append, "ran")
        with pytest.raises(HostFuncError, match="bad grammar state") as info:
            s.synchronize(timeout=30)
        assert isinstance(info.value.__cause__, ValueError)
        assert after == ["ran"]  # later callbacks still run, as on a CUDA stream
        s.synchronize(timeout=30)  # reported once
    finally:
        s.close()


def test_registry_keeps_captured_user_data_until_freed():
    x = torch.zeros(3, dtype=torch.int32)
    key = hostfunc._register(lambda t: t.add_(1), (x,), {}, keep=True)  # as a captured launch
    for _ in range(3):  # graph replays call the trampoline through its C function pointer
        hostfunc._TRAMPOLINE(key)
    assert x.tolist() == [3, 3, 3] and key in hostfunc.registered_keys() and hostfunc.runs_of(key) == 3
    hostfunc.free_host_func_user_data(key)
    assert key not in hostfunc.registered_keys()
    with pytest.raises(ValueError):
        hostfunc.free_host_func_user_data(key)


def test_uncaptured_user_data_is_freed_after_one_run():
    calls = []
    key = hostfunc._register(calls.append, ("once",), {}, keep=False)
    hostfunc._TRAMPOLINE(key)
    assert calls == ["once"] and key not in hostfunc.registered_keys()
    hostfunc._TRAMPOLINE(key)  # a stale key is logged, never run
    assert calls == ["once"]


def test_cuda_host_function_errors_are_raised_not_swallowed():
    def bad():
        raise KeyError("slot 3 has no grammar matcher")
    key = hostfunc._register(bad, (), {}, keep=False)
    hostfunc._TRAMPOLINE(key)  # an exception must not cross into the driver...
    with pytest.raises(HostFuncError, match="slot 3") as info:  # ...it is raised at the next sync
        hostfunc.raise_pending()
    assert isinstance(info.value.__cause__, KeyError)
    hostfunc.raise_pending()


# ---- the decoder against the plain one (no model) ----------------------------------------------

def _capital_grammar(service):
    sample = next(s for s in load_guided_samples() if s.name == "trtllm_json_schema_capital.json")
    return service.compile(sample.params)


def test_capturable_decoder_matches_the_plain_decoder(service, hf_tokenizer):
    """The step protocol (snapshot, fill + walk of host drafts, masks, commit from out_host) on a
    worker thread gives the plain decoder's masks and matcher state."""
    compiled = _capital_grammar(service)
    text = '{"name": "Paris", "population": 2161000}'
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    plain = GuidedDecoder(4, 3, VOCAB)
    cap = CapturableGuidedDecoder(GuidedDecoder(4, 3, VOCAB), WorkerStream(delay_s=0.002), torch.device("cpu"))
    R, step = cap.rows_per_slot, cap.stepper  # the host facade and the step protocol it runs on
    try:
        plain.add(1, compiled)
        cap.admit(1, compiled)
        cap.admit(0, None)
        logits = torch.randn(2, VOCAB)
        pos = 0
        while pos < len(ids):
            drafts = (ids[pos: pos + 2] + [7]) if pos % 2 else ids[pos: pos + 3]  # a wrong draft sometimes
            fed = plain.fill_verify_rows({1: drafts})
            plain.rollback(1, fed[1])
            out = step.out_host.numpy()
            out[:] = 0
            out[2: 2 + len(drafts), 1] = drafts
            step.begin(GuidedStep(slots=[0, 1], guided=[False, True], drafting=Drafting.HOST, ks=[0, len(drafts)]))
            step.launch_begin()
            for i in range(fed[1] + 1):
                a, b = logits.clone(), logits.clone()
                plain.apply(a[1:], [(1, i)])
                step.apply_rows(b, torch.tensor([0 * R + i, 1 * R + i]))
                assert torch.equal(a[1], b[1]) and torch.equal(b[0], logits[0])
            assert int(step.limit_dev[1]) == fed[1] and int(step.limit_dev[0]) == NO_LIMIT
            a = min(fed[1], 1, len(ids) - pos - 1)  # accept up to one draft, then the next token
            emit = ids[pos: pos + a + 1]
            out[0, 1], out[1, 1] = a, emit[-1]
            step.launch_commit()
            step.step_done()
            assert step.limits() == [NO_LIMIT, fed[1]]
            for t in emit:
                assert plain.advance(1, t) and cap.advance(1, t)
                assert plain.is_terminated(1) == cap.is_terminated(1)
            pos += len(emit)
        assert cap.num_tokens(1) == plain.num_tokens(1) == len(ids)
        assert cap.check_fresh(1, ids) is None and plain.check_fresh(1, ids) is None
        assert not cap.advance(1, ids[0])  # nothing committed that the host did not confirm
    finally:
        cap.close()



def test_the_host_confirms_each_commit_once(service, hf_tokenizer):
    """The stepper hands each commit's counts to the host facade once: waiting for a step whose
    commit never ran (a step that failed first; on CUDA `begin` marks the commit pending) hands
    over nothing, so tokens the host already confirmed are not confirmed again."""
    tok = hf_tokenizer.encode('{"name"', add_special_tokens=False)[0]
    cap = CapturableGuidedDecoder(GuidedDecoder(4, 3, VOCAB), InlineStream(), torch.device("cpu"))
    step = cap.stepper
    try:
        cap.admit(1, _capital_grammar(service))
        out = step.out_host.numpy()
        out[:] = 0
        out[1, 0] = tok  # batch row 0 (slot 1): no draft accepted, the next token
        step.begin(GuidedStep(slots=[1], guided=[True]))
        step.launch_begin()
        step.launch_commit()
        step.step_done()
        assert cap.advance(1, tok) and not cap.advance(1, tok)
        step.begin(GuidedStep(slots=[1], guided=[True]))  # the next step fails before its commit
        step._commit_pending, step._commit_ev = True, step.stream.record()  # as `begin` marks it on CUDA
        assert not cap.advance(1, tok) and cap.num_tokens(1) == 1
    finally:
        cap.close()

# ---- the engine: worker / inline executors == plain decoder, token for token -------------------

# name[@backend] ('' = auto: JSON on llguidance, the rest on xgrammar): both backends in one batch
GUIDES = ["trtllm_json_schema_capital.json", "sglang_regex_date.regex", "trtllm_ebnf_capital.gbnf",
          "sglang_ebnf_phone.gbnf", "trtllm_json_schema_capital.json@xgrammar", "sglang_regex_phone.regex@llguidance"]
TEXTS = ["Repeat this sentence three times: the cat sat on the mat.", "Write a haiku about the sea.",
         "List three primary colors."]


def _prefix_of(got, longer) -> bool:
    """Each output of a shorter-max_tokens run is a prefix of the longer run's, where it must be: not
    for JSON and regex guides, whose answers close within their own max_tokens (guided/budget.py)."""
    closing = [i for i, g in enumerate(GUIDES) if "json" in g or "regex" in g]
    return all(g[0] == r[0][: len(g[0])] for i, (g, r) in enumerate(zip(got, longer)) if i not in closing)


def _requests(engine, k_of, max_tokens=32, sampled=()):
    samples = {s.name: s for s in load_guided_samples()}
    chat = lambda t: engine.tokenizer.apply_chat_template([{"role": "user", "content": t}])  # noqa: E731
    reqs = []
    for entry in GUIDES:
        name, _, backend = entry.partition("@")
        s = samples[name]
        reqs.append((chat(f"Answer with {s.kind} output following this guide:\n{s.text[:600]}"),
                     dataclasses.replace(s.params, backend=backend)))
    reqs += [(chat(t), None) for t in TEXTS]
    return [Request(prompt=p, guided=g, num_draft_tokens=k_of(i),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.8 if i in sampled else 0.0, seed=i))
            for i, (p, g) in enumerate(reqs)]


def _run(engine, reqs):
    from ..engine.test_guided_engine import run_many

    return [(toks, final.finish_reason, final.total_draft_tokens, final.total_accepted_draft_tokens)
            for toks, _, final in run_many(engine, reqs, timeout=300)]


def _engine(**kw):
    # spec_max_rows=0 and cost_aware_k off: K never depends on how many requests share a step (compile
    # timing) or on measured step times, so draft and acceptance counts are reproducible across
    # engines, not only the tokens; n-gram drafts unless a test names another drafter
    cfg = dict(max_slots=8, max_seq_len=512, prefill_chunk=64, warmup=False, spec_max_rows=0, cost_aware_k=False,
               drafter="ngram")
    return Engine(EngineConfig(**{**cfg, **kw}))


@pytest.fixture(scope="module")
def plain_engine():
    eng = _engine(guided_executor="inline")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def worker_engine():
    eng = _engine(guided_executor="worker")
    eng.core.guided.stepper.configured.delay_s = 2e-4  # widen any window in which the host reads too early
    yield eng
    eng.shutdown()
    assert not eng.core.guided.stepper.configured.thread.is_alive()


@pytest.fixture(scope="module")
def reference(plain_engine):
    """Plain decoding (no speculation) with the plain GuidedDecoder."""
    return _run(plain_engine, _requests(plain_engine, k_of=lambda i: 0))


MIXED_K = (3, 0, 3, 2, 3, 2, 3, 0, 1)  # per request: speculation on / off inside one batch


def test_worker_executor_gives_the_plain_tokens_without_speculation(worker_engine, reference):
    problems = []
    original = worker_engine.core.step

    def step():  # invariant 3 after every step, read once the callbacks are done
        worked = original()
        for slot, seq in list(worker_engine.core.scheduler.running.items()):
            if seq.guide.grammar is not None and worker_engine.core.guided.is_guided(slot):
                err = worker_engine.core.guided.check_fresh(slot, seq.output_ids)
                if err:
                    problems.append(err)
        return worked
    worker_engine.core.step = step
    try:
        got = _run(worker_engine, _requests(worker_engine, k_of=lambda i: 0))
    finally:
        del worker_engine.core.step
    assert [g[:2] for g in got] == [r[:2] for r in reference]
    assert not problems, problems[:3]
    assert sum(1 for toks, reason, _, _ in got[: len(GUIDES)] if reason == "stop") >= 2  # grammars end


def test_worker_and_inline_executors_give_the_plain_tokens_with_ngram_speculation(plain_engine, worker_engine,
                                                                                  reference):
    plain = _run(plain_engine, _requests(plain_engine, k_of=lambda i: MIXED_K[i], max_tokens=16))
    worker = _run(worker_engine, _requests(worker_engine, k_of=lambda i: MIXED_K[i], max_tokens=16))
    assert _prefix_of(worker, reference)
    assert worker == plain  # same drafts proposed and accepted, not just the same tokens
    assert sum(w[2] for w in worker) > 0 and sum(w[3] for w in worker) > 0
    worker_engine.core.guided.synchronize()  # then the same engine with callbacks run inline
    worker_stream, worker_engine.core.guided.stepper.configured = worker_engine.core.guided.stepper.configured, InlineStream()
    try:  # shorter: tokens are a prefix of the plain run's
        got = _run(worker_engine, _requests(worker_engine, k_of=lambda i: MIXED_K[i], max_tokens=12))
    finally:
        worker_engine.core.guided.stepper.configured = worker_stream
    assert _prefix_of(got, plain) and sum(g[3] for g in got) > 0
    for eng in (plain_engine, worker_engine):
        eng.core.scheduler.check_integrity()
        assert not any(eng.core.guided.is_guided(s) for s in range(8))


def _dry_run_graphs(eng) -> StepGraphs:
    """StepGraphs on CPU: `replay` runs the captured step's body eagerly (no CUDA), so its static
    buffers, padding rows, key-length buckets, in-body grammar callbacks and acceptance run here."""
    eng.core.step_graphs = StepGraphs(eng.core.runner.core)
    return eng.core.step_graphs


def test_step_graph_body_dry_run_gives_the_plain_tokens(plain_engine, worker_engine):
    reqs = lambda e: _requests(e, k_of=lambda i: MIXED_K[i], max_tokens=20, sampled={1, 5})  # noqa: E731
    want = _run(plain_engine, reqs(plain_engine))
    graphs = _dry_run_graphs(worker_engine)
    try:
        got = _run(worker_engine, reqs(worker_engine))
    finally:
        worker_engine.core.step_graphs = None
    assert got == want  # tokens, finish reasons, drafts and acceptance (greedy and sampled rows)
    keys = set(graphs.graphs)
    assert graphs.stats.steps > 0 and any(k.drafting == "host" and k.guided for k in keys)
    assert any(not k.greedy for k in keys) and any(k.batch > 1 for k in keys)


def test_worker_executor_with_masked_early_exit_drafts(reference):
    kw = dict(drafter="early_exit", draft_layers=20)
    plain, worker = _engine(guided_executor="inline", **kw), _engine(guided_executor="worker", **kw)
    try:
        worker.core.guided.stepper.configured.delay_s = 2e-4
        a = _run(plain, _requests(plain, k_of=lambda i: MIXED_K[i], max_tokens=16))
        b = _run(worker, _requests(worker, k_of=lambda i: MIXED_K[i], max_tokens=16))
        graphs = _dry_run_graphs(worker)  # K draft forwards + verification as one step body
        c = _run(worker, _requests(worker, k_of=lambda i: MIXED_K[i], max_tokens=16))
        keys = set(graphs.graphs)
    finally:
        plain.shutdown()
        worker.shutdown()
    assert b == a  # masked drafts walk the grammar in callbacks: same drafts, same acceptance
    assert c == a and any(k.drafting == "model" and k.guided for k in keys)
    assert not graphs.graphs  # shutdown closed the step graphs
    assert _prefix_of(b, reference)  # == plain decoding
    assert sum(x[3] for x in b) > 0
