"""End-to-end engine behaviour on the real SmolLM2: greedy parity with transformers, in-flight
batching, seeded sampling, stop conditions, cancellation, validation."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specguide.request import InvalidRequestError, Request, SamplingParams

from .conftest import PROMPTS, run_alone


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@torch.inference_mode()
def test_greedy_matches_transformers_generate(fp32_engine, hf_model):
    engine = fp32_engine  # transformers computes in float32: the float32 model's greedy tokens
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        toks, text, final = run_alone(engine, Request(prompt_ids=ids, params=greedy(64, ignore_eos=True)))
        assert toks == ref, prompt
        assert final.finish_reason == "length" and final.num_output_tokens == 64
        assert text == engine.tokenizer.decode(toks)


def test_staggered_batch_of_8_equals_alone(engine):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
    # one token a step (no drafts): request 0 decodes for 24 steps while the next ones arrive, each
    # once the one before has its first token, so the batch fills whatever the machine's speed
    reqs = [Request(prompt=p, params=greedy(24 + 3 * i, ignore_eos=True), num_draft_tokens=0)
            for i, p in enumerate(prompts)]
    alone = [run_alone(engine, r)[0] for r in reqs]
    results: dict[int, list[int]] = {}
    done = threading.Event()
    started = [threading.Event() for _ in reqs]
    max_active = [0]

    def cb_for(i):
        def cb(out):
            started[i].set()
            results.setdefault(i, []).extend(out.token_ids)
            max_active[0] = max(max_active[0], engine.stats()["active_slots"])
            if out.finished and len([k for k in results if results[k]]) == 8 and out.finish_reason:
                if all(len(results[k]) == 24 + 3 * k for k in results):
                    done.set()
        return cb

    for i, r in enumerate(reqs):
        engine.submit(r, cb_for(i))
        assert started[i].wait(60)  # arrive while the others decode
    assert done.wait(120)
    assert [results[i] for i in range(8)] == alone
    assert max_active[0] >= 4  # they really ran together
    assert engine.stats()["active_slots"] == 0


def test_a_request_streams_its_first_token_before_the_next_prefill_of_its_step(engine, monkeypatch):
    """Requests prefilled in one step: each one's first token is sent when its own prompt is in,
    not after the other prompts' prefills (with 8 arrivals, the first would wait for 8 prefills)."""
    events: list[tuple[str, int]] = []
    prefill = engine.core.runner.prefill

    def recorded(chunk, *rest):
        events.append(("prefill", chunk.seq.seq_id))
        return prefill(chunk, *rest)

    monkeypatch.setattr(engine.core.runner, "prefill", recorded)
    done = threading.Semaphore(0)

    def callback(o):
        if o.token_ids:
            events.append(("token", o.seq_id))
        if o.finished:
            done.release()

    reqs = [Request(prompt=p, params=SamplingParams(max_tokens=3, temperature=0.0)) for p in PROMPTS[:3]]
    with engine._cv:  # the loop takes all three from its inbox at once: one step prefills them
        ids = [engine.submit(r, callback) for r in reqs]
    for _ in ids:
        assert done.acquire(timeout=120)
    order = [e for e in events if e[1] in ids]
    prefills = [i for i, e in enumerate(order) if e[0] == "prefill"]
    assert [order[i][1] for i in prefills] == ids, order  # one chunk each (short prompts), in order
    for k, seq_id in enumerate(ids):
        first = order.index(("token", seq_id))
        assert prefills[k] < first < (prefills[k + 1] if k + 1 < len(ids) else len(order)), order


def test_a_prompt_that_arrives_while_another_decodes_goes_through_its_steps_forward(engine, monkeypatch):
    """One token budget: a request that arrives while another decodes is prefilled in the same
    forward as that one's decode rows (rows of any length), not in a forward of its own that the
    running stream waits for; both outputs are what each gives alone."""
    late_req = Request(prompt=PROMPTS[2], params=SamplingParams(max_tokens=4, temperature=0.0))
    running_req = Request(prompt=PROMPTS[0], params=SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    late_alone, running_alone = run_alone(engine, late_req)[0], run_alone(engine, running_req)[0]
    engine.core.scheduler.forget_prefixes()  # (idle engine) the late prompt is computed, not reused
    model = engine.core.runner.model
    assert engine.core.runner.varlen  # the CPU kernels: rows of any length
    forward, rows = model.forward, []

    def recorded(ids, ctx, kv, *rest, **kw):
        if ctx.seg is not None:
            rows.append(ctx.seg.diff().tolist())
        return forward(ids, ctx, kv, *rest, **kw)

    monkeypatch.setattr(model, "forward", recorded)
    got: dict[str, list[int]] = {"late": [], "running": []}
    done = threading.Semaphore(0)

    def tracker(name):
        def callback(o):
            got[name].extend(o.token_ids)
            if o.finished:
                done.release()
        return callback

    engine.submit(running_req, tracker("running"))
    deadline = time.monotonic() + 120
    while len(got["running"]) < 4:  # it decodes now: each step has it in its batch
        assert time.monotonic() < deadline
        time.sleep(0.001)
    engine.submit(late_req, tracker("late"))
    for _ in range(2):
        assert done.acquire(timeout=120)
    n_late = len(engine.core.tokenizer.encode(PROMPTS[2]))
    # a forward whose rows are a decode row (the running stream's token and drafts) and the late prompt
    assert n_late > 8 and any(len(r) == 2 and min(r) <= engine.core.config.num_draft_tokens + 1
                              and max(r) >= n_late - 1 for r in rows), rows
    assert got["late"] == late_alone and got["running"] == running_alone
    assert engine.stats()["active_slots"] == 0


def test_stats_report_the_batch_and_kv_figures_the_trtllm_metrics_show(engine):
    seen = []
    steps = engine.stats()["steps"]
    # a prompt no earlier test sent: no prefix of it is reused, the whole prompt is one chunk
    req = Request(prompt="Stats: " + PROMPTS[0], params=greedy(40, ignore_eos=True), num_draft_tokens=0)
    done = threading.Event()

    def on_output(out):  # on the loop thread, right after the step that made this output
        if not out.finished:
            seen.append((out.first_token, out.num_input_tokens + out.num_output_tokens, engine.stats()))
        else:
            done.set()

    engine.submit(req, on_output)
    assert done.wait(120)
    first, n_first, s_first = seen[0]
    assert first and s_first["context_requests"] == 1 and s_first["generation_requests"] == 0
    assert s_first["context_tokens"] == n_first - 1  # the whole prompt in one chunk (prefill_chunk 64)
    _, n, s = seen[-1]
    assert (s["active_slots"], s["context_requests"], s["generation_requests"], s["context_tokens"]) == (1, 0, 1, 0)
    K = engine.config.num_draft_tokens  # a decoding sequence holds blocks for its tokens and K draft positions
    assert s["kv_tokens_per_block"] == 16 and s["max_slots"] == 8
    assert s["kv_blocks_max"] == 8 * -(-(512 + K + 1) // 16) and -(-n // 16) <= s["kv_blocks_used"] <= -(-(n + K) // 16)
    assert s["kv_blocks_used"] + s["kv_blocks_free"] <= s["kv_blocks_max"] and s["preempted"] == s["preemptions"] == 0
    assert s["steps"] - steps == len(seen) and s["step_time_us"] > 1e15  # one token a step; µs since the epoch
    assert s["cpu_mem_bytes"] > 100e6 and s["gpu_mem_bytes"] == 0 and s["pinned_mem_bytes"] == 0
    idle = engine.stats()
    assert (idle["active_slots"], idle["kv_blocks_used"], idle["context_requests"], idle["generation_requests"]) \
        == (0, 0, 0, 0)


def test_seeded_sampling_is_reproducible_and_batch_independent(engine):
    def req(seed):
        return Request(prompt=PROMPTS[3], params=SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95,
                                                                top_k=50, seed=seed, ignore_eos=True))
    a, _, _ = run_alone(engine, req(1234))
    b, _, _ = run_alone(engine, req(1234))
    c, _, _ = run_alone(engine, req(99))
    assert a == b
    assert a != c
    # the same seed inside a busy batch gives the same tokens
    outs = {}
    ev = threading.Event()
    for k, r in enumerate([req(7), req(1234), Request(prompt=PROMPTS[0], params=greedy(30))]):
        engine.submit(r, lambda o, k=k: (outs.setdefault(k, []).extend(o.token_ids),
                                         o.finished and k == 1 and ev.set()))
    assert ev.wait(60)
    assert outs[1] == a


def test_sampling_with_temperature_differs_from_greedy(engine):
    g, _, _ = run_alone(engine, Request(prompt=PROMPTS[3], params=greedy(32, ignore_eos=True)))
    s, _, _ = run_alone(engine, Request(prompt=PROMPTS[3], params=SamplingParams(
        max_tokens=32, temperature=1.5, seed=3, ignore_eos=True)))
    assert g != s


def test_max_tokens_cuts_exactly(engine):
    for n in (1, 2, 7):
        toks, text, final = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(n, ignore_eos=True)))
        assert len(toks) == n and final.num_output_tokens == n and final.finish_reason == "length"


def test_stop_word_cuts_text_exactly(engine):
    _, full, _ = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(20, ignore_eos=True)))
    # full starts with " Paris.\n\nThe answer is: ..." - stop on a word in the middle
    word = full.strip().split()[2]
    idx = full.find(word)
    assert idx > 0
    toks, text, final = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(20, ignore_eos=True,
                                                                                   stop=[word, "zzzz-never"])))
    assert final.finish_reason == "stop"
    assert text == full[:idx]
    assert len(toks) < 20
    # vLLM's include_stop_str_in_output: the text ends right after the stop string
    toks2, text2, final2 = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(
        20, ignore_eos=True, stop=[word, "zzzz-never"], include_stop_str_in_output=True)))
    assert (text2, toks2, final2.finish_reason) == (full[:idx + len(word)], toks, "stop")


def test_eos_and_end_id_stop(engine):
    toks, _, final = run_alone(engine, Request(prompt=PROMPTS[2], params=greedy(200)))
    assert final.finish_reason == "stop" and toks[-1] in engine.core.eos_token_ids
    _, full, _ = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(10, ignore_eos=True)))
    first = engine.tokenizer.encode(full)[2]
    toks, _, final = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(10, end_id=first)))
    assert final.finish_reason == "stop" and toks[-1] == first and first not in toks[:-1]


def test_min_tokens_and_bad_words(engine):
    natural, _, _ = run_alone(engine, Request(prompt=PROMPTS[2], params=greedy(200)))
    n = len(natural)
    toks, _, final = run_alone(engine, Request(prompt=PROMPTS[2], params=greedy(n + 20, min_tokens=n + 5)))
    assert len(toks) >= n + 5
    banned = natural[1]
    toks, _, _ = run_alone(engine, Request(prompt=PROMPTS[2], params=greedy(10, bad_words_ids=[[banned]])))
    assert banned not in toks and toks[0] == natural[0]


def test_penalties_discourage_repeats(engine):
    prompt = "<|im_start|>user\nList programming languages.<|im_end|>\n<|im_start|>assistant\n"
    plain, _, _ = run_alone(engine, Request(prompt=prompt, params=greedy(60, ignore_eos=True)))
    for kw in (dict(repetition_penalty=1.5), dict(frequency_penalty=1.0), dict(presence_penalty=1.5)):
        pen, _, _ = run_alone(engine, Request(prompt=prompt, params=greedy(60, ignore_eos=True, **kw)))
        assert pen != plain, kw
        assert len(set(pen)) > len(set(plain)), kw  # more distinct tokens
    # a penalized request in a batch does not change its neighbours' greedy output
    outs = {}
    ev = threading.Event()
    for k, r in enumerate([Request(prompt=prompt, params=greedy(60, ignore_eos=True, repetition_penalty=1.5)),
                           Request(prompt=prompt, params=greedy(60, ignore_eos=True))]):
        engine.submit(r, lambda o, k=k: (outs.setdefault(k, []).extend(o.token_ids),
                                         o.finished and len(outs.get(1 - k, [])) == 60 and ev.set()))
    assert ev.wait(60)
    assert outs[1] == plain


def test_cancel_frees_the_slot(engine):
    events = []
    ev = threading.Event()

    def cb(out):
        events.append(out)
        if out.finished:
            ev.set()
    sid = engine.submit(Request(prompt=PROMPTS[1], params=greedy(400, ignore_eos=True)), cb)
    deadline = time.time() + 30
    while len(events) < 3 and time.time() < deadline:
        time.sleep(0.01)
    engine.cancel(sid)
    assert ev.wait(10)
    assert events[-1].finish_reason == "cancelled" and events[-1].num_output_tokens < 400
    assert sum(o.finished for o in events) == 1
    time.sleep(0.05)
    assert engine.stats()["active_slots"] == 0
    engine.core.scheduler.check_integrity()
    toks, _, _ = run_alone(engine, Request(prompt=PROMPTS[0], params=greedy(3)))
    assert len(toks) == 3


def test_cancel_while_queued(engine):
    small = engine.config.max_slots
    ids, finals = [], {}
    ev = threading.Event()
    for i in range(small + 2):
        ids.append(engine.submit(Request(prompt=PROMPTS[0], params=greedy(30, ignore_eos=True)),
                                 lambda o, i=i: o.finished and (finals.__setitem__(i, o), len(finals) == small + 2 and ev.set())))
    engine.cancel(ids[-1])  # still waiting for a slot
    assert ev.wait(120)
    assert finals[small + 1].finish_reason == "cancelled" and finals[small + 1].num_output_tokens == 0
    assert all(finals[i].finish_reason == "length" for i in range(small + 1))
    engine.core.scheduler.check_integrity()


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt="x " * 600), "max_seq_len"),
    (dict(prompt=""), "empty"),
    (dict(), "prompt"),
    (dict(prompt_ids=[1, 10**7]), "out of range"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=-3)), "max_tokens"),
    (dict(prompt="hi", params=SamplingParams(max_tokens=10**6)), "limit"),
    (dict(prompt="hi", params=SamplingParams(temperature=-1)), "temperature"),
    (dict(prompt="hi", params=SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(prompt="hi", params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(prompt="hi", params=SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt="hi", params=SamplingParams(top_k=-1)), "top_k"),
    (dict(prompt="hi", num_draft_tokens=-1), "num_draft_tokens"),
    (dict(prompt="hi", num_draft_tokens=99), "num_draft_tokens"),
    (dict(prompt="hi", params=SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
    (dict(prompt="hi", params=SamplingParams(presence_penalty=3.0)), "presence_penalty"),
])
def test_bad_requests_are_clear_errors(engine, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.submit(Request(**kwargs))
    assert engine.is_alive()


def test_shutdown_drains_in_flight_requests():
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    # a quick engine (float32 weights load in ~3 s; the served weights' exact block recovery takes ~10)
    eng = Engine(EngineConfig(max_slots=2, max_seq_len=128, warmup=False, weight_dtype="float32"))
    finals = []
    for p in PROMPTS[:3]:
        eng.submit(Request(prompt=p, params=greedy(5, ignore_eos=True)), lambda o: o.finished and finals.append(o))
    eng.shutdown(drain=True, timeout=60)
    assert [f.finish_reason for f in finals] == ["length"] * 3
    assert not eng.is_alive()
