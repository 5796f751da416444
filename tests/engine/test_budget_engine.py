"""Issue 33 with the real model: JSON answers close valid within max_tokens by default (the served
drafter, speculation lossless against the same guided run without it); a budget that cannot hold
the schema's shortest document is refused up front; the close is an opt-out."""
from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from specguide.guided.value_check import make_validator
from specguide.request import GuidedDecodingParams, Request, SamplingParams
from specguide.training.prompts import load_schemas, schema_message

from .test_guided_engine import run_many

MAX_TOKENS = 48  # far below what these answers take: the budget closes most of them


@pytest.fixture(scope="module")
def held_out(engine):
    """(prompt, schema) for 5 held-out JSONSchemaBench schemas (never trained on, not the tests')."""
    out = []
    for text in load_schemas("heldout", engine.core.compiler)[:5]:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_message(text)}])
        out.append((prompt, text))
    return out


def requests(held_out, **guide):
    return [Request(prompt=p, params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
                    guided=GuidedDecodingParams("json_schema", s, **guide)) for p, s in held_out]


def test_answers_close_valid_within_max_tokens_and_speculation_stays_lossless(engine, held_out):
    base = requests(held_out)
    off = run_many(engine, [dataclasses.replace(r, num_draft_tokens=0) for r in base])
    on = run_many(engine, base)  # the engine's drafter and K
    closed = 0
    for (toks, text, final), (toks_on, text_on, final_on), (_, schema) in zip(off, on, held_out):
        assert final.finish_reason == "stop", (final.error, text)
        assert len(toks) <= MAX_TOKENS
        assert make_validator(json.loads(schema)).is_valid(json.loads(text)), text
        assert (toks_on, text_on, final_on.finish_reason, final_on.guide_notes) == \
               (toks, text, final.finish_reason, final.guide_notes)
        closed += any(n.startswith("closed by the budget") for n in final.guide_notes)
    assert closed >= 3  # most of these answers need more than 48 tokens: the budget ended them
    assert sum(f.total_accepted_draft_tokens for _, _, f in on) > 0
    opted_out = run_many(engine, requests(held_out, complete_within_budget=False))
    cut = [text for _, text, f in opted_out if f.finish_reason == "length"]
    assert len(cut) >= 3  # without the close: cut-off JSON
    for text in cut:
        with pytest.raises(ValueError):
            json.loads(text)


def test_a_budget_that_cannot_hold_the_shortest_document_is_refused_up_front(engine, held_out):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "age": {"type": "integer", "minimum": 18}},
              "required": ["name", "city", "age"]}
    prompt, _ = held_out[0]
    bad = Request(prompt=prompt, params=SamplingParams(max_tokens=6, temperature=0.0),
                  guided=GuidedDecodingParams("json_schema", json.dumps(schema)))
    fine = Request(prompt=prompt, params=SamplingParams(max_tokens=40, temperature=0.0),
                   guided=GuidedDecodingParams("json_schema", json.dumps(schema)))
    (_, _, refused), (_, text, ok) = run_many(engine, [bad, fine])
    assert refused.finish_reason == "error" and refused.error_code == "INVALID_ARG"
    assert "max_tokens 6 cannot hold a valid answer: the shortest one this guide accepts takes" in refused.error
    assert ok.finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


def test_a_regex_answer_closes_within_max_tokens(engine):
    """A regex guide whose matches run long (a sentence of up to 300 letters, then a full stop):
    with max_tokens 12 the answer still ends matching, "stop", lossless with speculation."""
    import re

    pattern = r"[A-Za-z ,]{1,300}\."
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Describe the sea at length."}])
    req = Request(prompt=prompt, params=SamplingParams(max_tokens=12, temperature=0.0),
                  guided=GuidedDecodingParams("regex", pattern))
    (toks, text, final), (toks_on, _, final_on) = run_many(engine, [dataclasses.replace(req, num_draft_tokens=0), req])
    assert final.finish_reason == "stop" and len(toks) <= 12 and re.fullmatch(pattern, text), (final.error, text)
    assert any(n.startswith("closed by the budget") for n in final.guide_notes)
    assert (toks_on, final_on.finish_reason) == (toks, "stop")


def test_tool_calls_close_whole_within_max_tokens(engine):
    """A tool-call guide (`tool_choice: required`, parallel calls; the OpenAI server's structural
    tag): the default model writes call after call; the budget ends the answer after the last call
    another could not follow, every call whole and valid, "stop", lossless with speculation.
    Without the budget the answer runs to max_tokens and its last call is cut."""
    from specguide.openai_api.schemas import Tool, ToolChoiceMode
    from specguide.openai_api.tools import parse_all, tool_guide, tools_system_prompt

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
              "required": ["city"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": schema}})]
    tag = json.dumps(tool_guide(tools, ToolChoiceMode.REQUIRED, parallel=True))
    prompt = engine.tokenizer.apply_chat_template([{"role": "system", "content": tools_system_prompt(tools)},
                                                   {"role": "user", "content": "Weather in Paris, Rome and Oslo?"}])
    req = Request(prompt=prompt, params=SamplingParams(max_tokens=140, temperature=0.0),
                  guided=GuidedDecodingParams("structural_tag", tag))
    (toks, text, final), (toks_on, _, final_on), (_, cut, uncapped) = run_many(engine, [
        dataclasses.replace(req, num_draft_tokens=0), req,
        dataclasses.replace(req, guided=GuidedDecodingParams("structural_tag", tag, complete_within_budget=False))])
    assert final.finish_reason == "stop" and len(toks) <= 140, (final.error, text)
    assert any(n.startswith("closed by the budget") for n in final.guide_notes)
    content, calls = parse_all(text)
    assert content is None and len(calls) >= 2, (len(toks), text)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schema)
    assert (toks_on, final_on.finish_reason) == (toks, "stop")
    assert uncapped.finish_reason == "length" and not cut.endswith("</tool_call>")


def test_guides_that_expand_too_far_are_refused_at_intake_and_bounded_past_it(engine, held_out):
    """Issue 75: arrays nested 10 deep with minItems 1000 (10^30 integers) and `(a{4000}){4000}`
    (16M characters; each bound alone is allowed) are refused at submit, naming
    guided_max_expansion. With that check off they compile (lazily, in ms), and the budget's step
    on the engine loop refuses them at once without building their shortest answers (before: a
    MemoryError after seconds, 35 s for the regex); the engine serves the next request."""
    from specguide.request import InvalidRequestError

    nested: dict = {"type": "integer"}
    for _ in range(10):
        nested = {"type": "array", "minItems": 1000, "items": nested}
    prompt, _ = held_out[0]
    guides = [GuidedDecodingParams("json_schema", json.dumps(nested)), GuidedDecodingParams("regex", "(a{4000}){4000}")]
    reqs = [Request(prompt=prompt, params=SamplingParams(max_tokens=16, temperature=0.0), guided=g) for g in guides]
    for req in reqs:
        with pytest.raises(InvalidRequestError, match=r"expands to \d+ repetitions.*the limit is 1048576 "
                                                      r"\(the setting guided_max_expansion"):
            engine.submit(req)
    limits = engine.core.compiler.limits
    engine.core.compiler.limits = dataclasses.replace(limits, max_expansion=0, max_repetition=0)
    try:
        ok = Request(prompt="The capital of France is", params=SamplingParams(max_tokens=4, temperature=0.0))
        *refused, (toks, _, fine) = run_many(engine, reqs + [ok])
    finally:
        engine.core.compiler.limits = limits
    for _, _, final in refused:
        assert final.finish_reason == "error" and final.error_code == "INVALID_ARG", final
        assert "max_tokens 16 cannot hold a valid answer" in final.error
    assert fine.finish_reason == "length" and len(toks) == 4
    engine.core.scheduler.check_integrity()
