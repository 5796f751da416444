"""Reasoning models (issue 18) on the real SmolLM2, both grammar backends: with `reasoning_markers`
the guide applies only after `</think>`; greedy speculation (n-gram, hybrid) equals speculation off
across the boundary, a draft window holding the marker included; no stop token inside the block.

SmolLM2 is no reasoning model: few-shot prompts make it write `<think>NAME is AGE.</think>` and then
the JSON (forced reasoning text, copied from the shots)."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams

from .conftest import run_alone
from .test_guided_engine import run_many

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
END = "</think>"
SHOTS = ('Q: Describe Alice, 30.\nA: <think>Alice is 30.</think>{sep}{{"name": "Alice", "age": 30}}\n\n'
         'Q: Describe Bob, 41.\nA: <think>Bob is 41.</think>{sep}{{"name": "Bob", "age": 41}}\n\n')


def prompt(who: str, age: int, closed: bool = False, sep: str = "\n") -> str:
    """The shots (`sep` after each `</think>`), then an answer whose think block is open (the model
    reasons) or already closed."""
    return SHOTS.format(sep=sep) + f"Q: Describe {who}, {age}.\nA: <think>" + (f"{who} is {age}.</think>{sep}" if closed else "")


def guide(backend: str) -> GuidedDecodingParams:
    return GuidedDecodingParams("json_schema", json.dumps(SCHEMA), backend=backend)


@pytest.fixture(scope="module", params=["ngram", "hybrid"])
def reasoning_engine(request, random_head):
    """K=4 with a fixed K; `hybrid` drafts in the step with an untrained head (lossless whatever it proposes),
    its grammar callbacks on a worker thread (the race test mode), and trusts n-gram chains from a 3-token
    match (the served 6 rarely chains these short shots; the random head never drafts across the boundary)."""
    eng = Engine(EngineConfig(max_slots=4, max_seq_len=512, prefill_chunk=64, num_draft_tokens=4,
                              drafter=request.param, draft_head_path=str(random_head), adaptive_k=False,
                              cost_aware_k=False, reasoning_markers="<think>,</think>", ngram_trust=3, ngram_max=4,
                              guided_executor="worker" if request.param == "hybrid" else "inline"))
    yield eng
    eng.shutdown()


@pytest.fixture
def windows(reasoning_engine):
    """Every verification step's draft windows: (last output tokens before it, drafts verified, accepted,
    drafts proposed by the host or None). After every engine step each guided slot's matcher equals a
    fresh one fed its accepted tokens (invariant 3)."""
    eng, seen = reasoning_engine, []
    original, engine_step = eng.core.runner.step, eng.core.step

    def checked_step():
        worked = engine_step()
        for slot, seq in list(eng.core.scheduler.running.items()):
            if seq.guide.grammar is not None and eng.core.guided.is_guided(slot):
                err = eng.core.guided.check_fresh(slot, seq.output_ids)
                assert err is None, err
        return worked

    def step(seqs, plan, *rest):
        before = [list(s.output_ids[-4:]) for s in seqs]
        out = original(seqs, plan, *rest)
        drafts = eng.core.runner.core.out_host.drafts.numpy()
        for b, (_, n, a) in enumerate(out):
            host = list(plan.drafts[b]) if plan.drafting == "host" else None
            seen.append((before[b], drafts[:n, b].tolist(), a, host))
        return out

    eng.core.runner.step, eng.core.step = step, checked_step
    yield seen
    del eng.core.runner.step, eng.core.step


def split(text: str) -> tuple[str, str]:
    thought, end, answer = text.partition(END)
    assert end, f"no {END} in {text!r}"
    return thought, answer


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_the_guide_applies_after_the_think_block_only(engine, reasoning_engine, backend):
    """The reasoning text is free (the guide alone refuses its first token) and part of the output; the
    answer after `</think>` is the guide's; without the setting the guide applies from the first token."""
    eng = reasoning_engine
    req = Request(prompt=prompt("Carol", 25), params=SamplingParams(max_tokens=48, temperature=0.0), guided=guide(backend))
    toks, text, final = run_alone(eng, req)
    assert final.finish_reason == "stop", final
    thought, answer = split(text)
    assert thought == "Carol is 25." and json.loads(answer) == {"name": "Carol", "age": 25}
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert not eng.core.compiler.compile(req.guided).matcher().accept(toks[0])  # the guide would refuse the block
    _, plain, _ = run_alone(engine, req)  # the same request on an engine without reasoning_markers
    assert plain.startswith("{") and END not in plain


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_lossless_across_the_boundary(reasoning_engine, windows, backend):
    """Greedy K=0 == K=4, token for token, for open and closed think blocks in one batch; draft windows
    hold the end marker: cut by the guide right after it (the shots' `\n`, which JSON refuses there),
    or accepted past it (drafts on both sides of the boundary in one step)."""
    eng = reasoning_engine
    base = [Request(prompt=prompt(w, a, closed=c, sep=sep), params=SamplingParams(max_tokens=48, temperature=0.0),
                    guided=guide(backend)) for w, a, c, sep in (("Carol", 25, False, "\n"), ("Dan", 60, False, ""),
                                                               ("Erin", 33, False, "\n"), ("Frank", 52, True, "\n"))]
    k0 = run_many(eng, [dataclasses.replace(r, num_draft_tokens=0) for r in base])
    windows.clear()
    k4 = run_many(eng, [dataclasses.replace(r, num_draft_tokens=4) for r in base])
    for (t0, x0, f0), (t4, x4, f4) in zip(k0, k4):
        assert t0 == t4 and x0 == x4 and f0.finish_reason == f4.finish_reason == "stop", (x0, x4)
    for _, text, _ in k4[:3]:
        jsonschema.validate(json.loads(split(text)[1]), SCHEMA)
    jsonschema.validate(json.loads(k4[3][1]), SCHEMA)  # the prompt closed the block: guided from the start
    assert sum(f.total_accepted_draft_tokens for _, _, f in k4) > 0
    end_ids = eng.tokenizer.encode(END)
    crossing = [w for w in windows if _ends_inside(w[0], w[1], end_ids)]
    assert any(_ends_inside(before, d[: a - 1], end_ids) for before, d, a, _ in crossing), crossing  # accepted past it
    if eng.core.drafter == "ngram":  # `\n` after `</think>` proposed by the n-gram, refused by the guide: cut there
        assert any(host is not None and len(host) > len(d) for _, d, _, host in crossing), crossing


def _ends_inside(before: list[int], drafts: list[int], marker: list[int]) -> bool:
    """The marker's last token is one of the drafts (the window crosses the boundary)."""
    seq, m = before + drafts, len(marker)
    return any(seq[i - m: i] == marker for i in range(max(len(before) + 1, m), len(seq) + 1))


def test_no_stop_token_inside_the_think_block(reasoning_engine):
    """Unguided, the model ends right away; guided, the answer must come, so the block goes on to
    max_tokens (`length`) without an EOS. Outside the block the guide decides, as always."""
    eng = reasoning_engine
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]) + "<think>"
    params = SamplingParams(max_tokens=40, temperature=0.0)
    free, _, free_final = run_alone(eng, Request(prompt=chat, params=params))
    assert free_final.finish_reason == "stop" and free[-1] in eng.core.eos_token_ids and len(free) < 40
    guided, text, final = run_alone(eng, Request(prompt=chat, params=params, guided=guide("llguidance")))
    assert final.finish_reason == "length" and len(guided) == 40 and END not in text
    assert guided[: len(free) - 1] == free[:-1] and not set(guided) & eng.core.eos_token_ids
