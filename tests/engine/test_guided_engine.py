"""Guided decoding inside the engine, on the real SmolLM2 with real xgrammar and llguidance (greedy)."""
from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from specguide.request import GuidedDecodingParams, Request, SamplingParams

from ..guided.helpers import check_output, load_guided_samples
from .conftest import run_alone

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}  # closed: greedy SmolLM2 adds keys otherwise


def chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def prompt_for(engine, sample) -> str:
    what = {"json_schema": "a JSON object that follows this JSON schema", "regex": "a string matching this regex",
            "choice": "one of these options", "structural_tag": "a function call in this format"}
    return chat(engine, f"Write {what.get(sample.kind, 'text in this grammar')}:\n{sample.text[:1500]}")


@pytest.fixture
def fresh_state_checker(engine):
    """Wrap engine.core.step: after every step, each guided slot's matcher equals a fresh one fed its tokens."""
    problems: list[str] = []
    checked = [0]
    original = engine.core.step

    def step():
        worked = original()
        for slot, seq in list(engine.core.scheduler.running.items()):
            if seq.guide.grammar is not None and engine.core.guided.is_guided(slot):
                err = engine.core.guided.check_fresh(slot, seq.output_ids)
                checked[0] += 1
                if err:
                    problems.append(f"seq {seq.seq_id}: {err}")
        return worked

    engine.core.step = step
    yield problems, checked
    del engine.core.step


def run_many(engine, requests, timeout=600):
    """Submit all at once; returns [(token ids, text, final event)] in order."""
    results = [([], [], None) for _ in requests]
    done = threading.Semaphore(0)

    def cb_for(i):
        def cb(out):
            results[i][0].extend(out.token_ids)
            results[i][1].append(out.text)
            if out.finished:
                results[i] = (results[i][0], results[i][1], out)
                done.release()
        return cb

    for i, r in enumerate(requests):
        engine.submit(r, cb_for(i))
    for _ in requests:
        assert done.acquire(timeout=timeout)
    return [(toks, "".join(parts), final) for toks, parts, final in results]


def test_all_guided_samples_give_valid_output(engine, fresh_state_checker):
    problems, checked = fresh_state_checker
    samples = load_guided_samples()
    reqs = [Request(prompt=prompt_for(engine, s), params=SamplingParams(max_tokens=320, temperature=0.0),
                    guided=s.params) for s in samples]
    results = run_many(engine, reqs)
    finished_by_grammar = 0
    for sample, (toks, text, final) in zip(samples, results):
        assert final.finish_reason in ("stop", "length"), (sample.name, final.error)
        compiled = engine.core.compiler.compile(sample.params)
        matcher = compiled.matcher()
        assert all(matcher.accept(t) for t in toks), sample.name  # every token was grammar-valid
        if final.finish_reason == "stop":
            finished_by_grammar += 1
            assert matcher.is_terminated(), sample.name
            check_output(sample, text)  # jsonschema / regex fullmatch / choice membership
    # NOTE: greedy SmolLM2-135M loops inside a few unbounded arrays/strings (31/38 end by grammar
    # within 320 tokens); those outputs are still grammar-valid prefixes (checked above)
    assert finished_by_grammar >= 0.75 * len(samples), f"{finished_by_grammar}/{len(samples)} ended by grammar"
    assert not problems, problems[:5]
    assert checked[0] > 100
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


def test_mixed_guided_and_unguided_batch_equals_alone(engine):
    schema = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))
    reqs = []
    for i, who in enumerate(["Alice, 30", "Bob, 41", "Carol, 25", "Dan, 60"]):
        reqs.append(Request(prompt=chat(engine, f"Describe the person {who} as JSON."),
                            params=SamplingParams(max_tokens=48, temperature=0.0), guided=schema))
        reqs.append(Request(prompt=chat(engine, f"Tell me about {who.split(',')[0]}."),
                            params=SamplingParams(max_tokens=24 + i, temperature=0.0)))
    alone = [run_alone(engine, r) for r in reqs]
    together = run_many(engine, reqs)
    for (a_toks, a_text, a_final), (b_toks, b_text, b_final) in zip(alone, together):
        assert a_toks == b_toks and a_text == b_text and a_final.finish_reason == b_final.finish_reason
    for toks, text, final in alone[0::2]:
        assert final.finish_reason == "stop"
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)


def test_sampled_guided_output_is_valid(engine):
    schema = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))
    for seed in range(3):
        toks, text, final = run_alone(engine, Request(
            prompt=chat(engine, "Describe a person as JSON."), guided=schema,
            params=SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, seed=seed)))
        if final.finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert final.finish_reason == "length"


def test_the_sparse_lm_head_changes_no_token(engine, monkeypatch):
    """A guided step's LM head computes only the output tiles its masks allow (`sparse_lm_head`, on
    by default): greedy and seeded sampled answers, alone and speculated, are the same tokens as with
    every tile computed, and the sparse head really ran on a small share of the tiles."""
    from specguide import kernels

    if not engine.core.runner.core.sparse_lm_head or not hasattr(engine.core.model.head, "forward_tiles"):
        pytest.skip("the LM head is not a C-kernel head here")
    used = []
    real = kernels.gemv_tiles
    monkeypatch.setattr(kernels, "gemv_tiles",
                        lambda x, p, a, O, sel, wd, out=None: used.append(sel.numel()) or real(x, p, a, O, sel, wd, out))
    schema = GuidedDecodingParams("json_schema", json.dumps(SCHEMA))
    reqs = [Request(prompt=chat(engine, f"Describe {who} as JSON."), guided=schema, num_draft_tokens=k,
                    params=SamplingParams(max_tokens=48, temperature=t, top_p=0.95, seed=3))
            for who in ("Alice", "a pilot") for k in (0, 3) for t in (0.0, 1.0)]
    sparse = [run_alone(engine, r) for r in reqs] + run_many(engine, reqs)
    assert used and sum(used) / len(used) < 0.5 * engine.core.model.head.out_features / kernels.TILE, used[:20]
    monkeypatch.setattr(engine.core.runner.core, "sparse_lm_head", False)
    calls = len(used)
    full = [run_alone(engine, r) for r in reqs] + run_many(engine, reqs)
    assert len(used) == calls  # every tile, every step
    for (a, ta, fa), (b, tb, fb) in zip(sparse, full):
        assert a == b and ta == tb and fa.finish_reason == fb.finish_reason


@pytest.mark.parametrize("guide_type, guide, match", [
    ("regex", "(ab", "regex"),
    ("ebnf_grammar", 'start ::= "a"', "root"),
    ("json_schema", '{"type": "object", "properties": ', "JSON"),
    ("json_schema", '"not a schema"', "schema"),
    ("bogus", "x", "guide"),
])
def test_bad_guides_fail_only_their_request(engine, guide_type, guide, match):
    from specguide.request import InvalidRequestError

    ok = Request(prompt="The capital of France is", params=SamplingParams(max_tokens=6, temperature=0.0))
    bad = Request(prompt="hi", params=SamplingParams(max_tokens=6), guided=GuidedDecodingParams(guide_type, guide))
    try:
        results = run_many(engine, [ok, bad, ok])
    except InvalidRequestError as exc:  # malformed guides are refused at submit
        assert match.lower() in str(exc).lower()
        results = run_many(engine, [ok, ok])
    else:
        final = results[1][2]
        assert final.finish_reason == "error" and final.error_code == "INVALID_ARG"
        assert match.lower() in final.error.lower(), final.error
        results = [results[0], results[2]]
    assert all(r[2].finish_reason == "length" and len(r[0]) == 6 for r in results)
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


def test_cancel_while_grammar_compiles_and_guided_max_tokens(engine):
    # a fresh (uncached) schema: cancel right after submit, while it compiles or waits
    schema = dict(SCHEMA, properties=dict(SCHEMA["properties"], city={"type": "string", "maxLength": 17}))
    events = []
    ev = threading.Event()
    sid = engine.submit(Request(prompt="x", params=SamplingParams(max_tokens=20),
                                guided=GuidedDecodingParams("json_schema", json.dumps(schema))),
                        lambda o: (events.append(o), o.finished and ev.set()))
    engine.cancel(sid)
    assert ev.wait(30) and events[-1].finish_reason == "cancelled"
    # max_tokens cuts a guided output before the grammar ends (the budget's close opted out): "length",
    # slot and matcher freed
    guide = GuidedDecodingParams("json_schema", json.dumps(SCHEMA), complete_within_budget=False)
    toks, text, final = run_alone(engine, Request(prompt=chat(engine, "Describe a person as JSON."),
                                                  params=SamplingParams(max_tokens=3, temperature=0.0), guided=guide))
    assert final.finish_reason == "length" and len(toks) == 3
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


@pytest.fixture(scope="module")
def engine_k4():
    """K=4, grammar-forced then n-gram drafts (each backend's forced tokens), fixed K."""
    from specguide.config import EngineConfig
    from specguide.engine.loop import Engine

    eng = Engine(EngineConfig(max_slots=4, max_seq_len=512, prefill_chunk=64, num_draft_tokens=4, drafter="grammar",
                              adaptive_k=False, cost_aware_k=False))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("backend,checked", [("xgrammar", False), ("llguidance", False), ("xgrammar", True),
                                             ("llguidance", True)])
def test_lossless_k0_vs_k4_under_a_json_schema_per_backend(engine_k4, backend, checked):
    """Invariant 1 per backend: greedy K=0 == greedy K=4 token for token under a json_schema guide
    with spec-true defaults; outputs ended by the grammar validate with jsonschema (invariant 4).
    `checked`: keywords left to the value check (uniqueItems; llguidance: any key order too)."""
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer"}, "city": {"type": "string", "maxLength": 16}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    if checked:
        schema["properties"]["hobbies"] = {"type": "array", "items": {"type": "string", "maxLength": 12},
                                           "maxItems": 3, "uniqueItems": True}
    guide = GuidedDecodingParams("json_schema", json.dumps(schema), backend=backend,
                                 any_key_order=checked and backend == "llguidance")
    engine = engine_k4
    fields = "name, age, city and hobbies" if checked else "name, age and city"
    prompts = [chat(engine, f"Describe {who} as JSON with {fields}.") for who in ("Alice", "Bob", "a pilot")]
    base = [Request(prompt=p, params=SamplingParams(max_tokens=90 if checked else 60, temperature=0.0), guided=guide)
            for p in prompts]
    k0 = run_many(engine, [dataclasses.replace(r, num_draft_tokens=0) for r in base])
    k4 = run_many(engine, [dataclasses.replace(r, num_draft_tokens=4) for r in base])
    stops = 0
    for (t0, x0, f0), (t4, x4, f4) in zip(k0, k4):
        assert t0 == t4 and x0 == x4 and f0.finish_reason == f4.finish_reason
        if f0.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(x0), schema)
    assert stops >= 2
    assert sum(f.total_accepted_draft_tokens for _, _, f in k4) > 0  # speculation really ran
    assert sum(f.total_draft_tokens for _, _, f in k0) == 0


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_value_checked_output_is_valid_or_an_error_naming_the_violation(engine, backend):
    """uniqueItems cannot be a grammar: the value is checked when it closes (a closing token that fails
    is masked), so a request ends valid (jsonschema, uniqueItems included) or with an error naming it."""
    import jsonschema

    schema = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "maximum": 3},
                                                       "minItems": 2, "maxItems": 3, "uniqueItems": True}},
              "required": ["ids"], "additionalProperties": False}
    prompt = chat(engine, "Give three ids as JSON.")
    guide = GuidedDecodingParams("json_schema", json.dumps(schema), backend=backend)
    results = run_many(engine, [Request(prompt=prompt, params=SamplingParams(max_tokens=40, temperature=t, seed=s),
                                        guided=guide) for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))])
    stops = 0
    for toks, text, final in results:
        assert final.guide_notes == ("checked when its value closes: uniqueItems at /properties/ids",), final.guide_notes
        if final.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(text), schema)
        else:
            assert final.finish_reason == "length" or "violates the JSON schema" in final.error, final.error
    assert stops >= 1


def _wide_schema(n: int) -> str:
    return json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


def test_a_guide_past_llguidance_limits_fails_alone_with_its_reason(engine):
    """llguidance's mask may allow a token whose consumption then trips its parser limit (an object
    with 600 optional properties: a row of 2407 items, max 2000). That request ends with INVALID_ARG
    naming the limit; a guided request beside it finishes as it does alone; nothing leaks."""
    good = Request(prompt=chat(engine, "Give a person as JSON."), params=SamplingParams(max_tokens=40, temperature=0.0),
                   guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)))
    wide = Request(prompt=chat(engine, "Give a JSON object."), params=SamplingParams(max_tokens=40, temperature=0.0),
                   guided=GuidedDecodingParams("json_schema", _wide_schema(600), backend="llguidance"))
    alone = run_alone(engine, dataclasses.replace(good))
    results = run_many(engine, [good, wide, good])
    final = results[1][2]
    assert final.finish_reason == "error" and final.error_code == "INVALID_ARG", final
    assert "too complex for the llguidance backend" in final.error and "max is 2000" in final.error
    assert "<grammar>" not in final.error  # llguidance's diagnostic dump stays out of the message
    assert results[0][0] == results[2][0] == alone[0]
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


def test_auto_routes_objects_wider_than_llguidance_takes_to_xgrammar(engine):
    from specguide.guided.compiler import LLG_MAX_OBJECT_PROPERTIES

    svc = engine.core.compiler
    narrow = GuidedDecodingParams("json_schema", _wide_schema(LLG_MAX_OBJECT_PROPERTIES))
    nested = json.dumps({"type": "object", "properties": {"inner": json.loads(_wide_schema(600))}})
    assert svc.backend_for(narrow) == "llguidance"
    assert svc.backend_for(GuidedDecodingParams("json_schema", nested)) == "xgrammar"
    assert svc.backend_for(GuidedDecodingParams("json_schema", nested, backend="llguidance")) == "llguidance"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_grammar_with_no_way_to_end_is_refused_before_its_first_step(engine, backend):
    """The fuzz suite's finding: such a grammar's first mask is empty, and the step answered with an
    internal error after its first token; now it is INVALID_ARG before any token."""
    req = Request(prompt=chat(engine, "Say yes."), params=SamplingParams(max_tokens=8, temperature=0.0),
                  guided=GuidedDecodingParams("ebnf_grammar", "root ::= x\nx ::= y\ny ::= x", backend=backend))
    ids, _, last = run_alone(engine, req)
    assert (last.finish_reason, last.error_code, ids) == ("error", "INVALID_ARG", []), last
    assert "grammar" in last.error


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_choice_the_vocabulary_cannot_write_ends_with_invalid_arg_alone(engine, backend):
    """The fuzz suite's finding: a choice whose later character no token encodes (U+B0CC5 is UTF-8
    F2 B0 B3 85; SmolLM2 has no token for byte F2) reaches a mask that allows nothing after "b".
    It was an internal error ("token 0 violates the grammar"); now it is the client's: INVALID_ARG
    naming the guide, after the tokens it could write. A request beside it is unharmed."""
    good = Request(prompt=chat(engine, "Give a person as JSON."), params=SamplingParams(max_tokens=24, temperature=0.0),
                   guided=GuidedDecodingParams("json_schema", json.dumps(SCHEMA)))
    dead = Request(prompt=chat(engine, "Pick one."), params=SamplingParams(max_tokens=8, temperature=0.0),
                   guided=GuidedDecodingParams("choice", json.dumps(["b\U000B0CC5"]), backend=backend))
    alone = run_alone(engine, dataclasses.replace(good))
    results = run_many(engine, [good, dead, good])
    ids, text, final = results[1]
    assert (final.finish_reason, final.error_code) == ("error", "INVALID_ARG"), final
    assert "choice guide allows no token after 1 output tokens" in final.error, final.error
    assert "".join(text) == "b"
    assert results[0][0] == results[2][0] == alone[0]
    engine.core.scheduler.check_integrity()
    assert not any(engine.core.guided.is_guided(s) for s in range(engine.config.max_slots))


def test_bad_words_that_ban_every_token_the_guide_allows_end_with_invalid_arg(engine):
    """A choice of one token, banned as a bad word: the masked row has no token left. The client's
    bans and guide conflict: INVALID_ARG, not an internal error."""
    tok = engine.tokenizer.encode("yes")
    assert len(tok) == 1, tok
    req = Request(prompt=chat(engine, "Say yes."), params=SamplingParams(max_tokens=8, temperature=0.0,
                                                                           bad_words_ids=[tok]),
                  guided=GuidedDecodingParams("regex", "yes"))
    ids, _, last = run_alone(engine, req)
    assert (last.finish_reason, last.error_code, ids) == ("error", "INVALID_ARG", []), last
    assert "bad_words ban every token the regex guide allows after 0 output tokens" in last.error
