"""logit_bias (OpenAI / vLLM): added to the target's logits at every position, so speculation stays
lossless; a slot's table never reaches the next request in that slot."""
from __future__ import annotations

import pytest

from specguide.request import InvalidRequestError, Request, SamplingParams

from .conftest import placed_in, run_alone
from .test_guided_engine import run_many
from .test_speculative import ngram_engine  # noqa: F401 (the fixture: n-gram drafts in every step)


@pytest.fixture
def eng(ngram_engine):  # noqa: F811
    return ngram_engine


def chat(eng, text: str) -> str:
    return eng.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def req(eng, text: str, k: int = 0, bias=None, **kw) -> Request:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 32), temperature=kw.pop("temperature", 0.0),
                            ignore_eos=True, logit_bias=dict(bias or {}), **kw)
    return Request(prompt=chat(eng, text), params=params, num_draft_tokens=k)


def test_a_large_bias_forces_a_token_and_its_log_prob_is_near_zero(eng):
    zebra = eng.tokenizer.encode(" zebra")[0]
    toks, _, _ = run_alone(eng, req(eng, "Say hello.", bias={zebra: 100}, max_tokens=6, return_log_probs=True))
    assert toks == [zebra] * 6
    outs = list(eng.generate(req(eng, "Say hello.", bias={zebra: 100}, max_tokens=3, return_log_probs=True)))
    assert all(lp > -1e-3 for o in outs for lp in o.logprobs)  # the distribution drawn from has the bias


def test_speculation_stays_lossless_with_a_bias(eng):
    """A ban (-100) on a token the plain answer repeats, and a nudge: K=0 and K=3 give the same tokens,
    greedy and seeded, and drafts are accepted; the banned token never appears."""
    text = "Repeat this sentence three times: the cat sat on the mat."
    plain, _, _ = run_alone(eng, req(eng, text, max_tokens=40))
    banned = max(set(plain), key=plain.count)
    bias = {banned: -100, eng.tokenizer.encode(" dog")[0]: 3.0}
    for kw in ({}, {"temperature": 0.8, "seed": 5}):
        off, _, _ = run_alone(eng, req(eng, text, 0, bias, max_tokens=40, **kw))
        on, _, final = run_alone(eng, req(eng, text, 3, bias, max_tokens=40, **kw))
        assert on == off and banned not in on, kw
        assert final.total_accepted_draft_tokens > 0, kw
    assert off != plain


def test_a_freed_slots_bias_does_not_reach_its_next_request(eng):
    """A biased request in slot 0, then an unbiased one in slot 0 beside a biased one elsewhere (a
    step with a biased row adds every row's table): the unbiased one answers as it does alone."""
    zebra = eng.tokenizer.encode(" zebra")[0]
    alone, _, _ = run_alone(eng, req(eng, "Name a fruit.", max_tokens=12))
    with placed_in(eng, 0):
        run_alone(eng, req(eng, "Say hello.", bias={zebra: 100}, max_tokens=4))
    sched = eng.core.scheduler
    take, picked = sched._take_slot, []

    def first_in_slot_0(seq):  # the first request admitted takes slot 0 (as placed_in), the next any other
        if picked:
            return take(seq)
        sched.free_slots.remove(0)
        picked.append(0)
        return 0

    sched._take_slot = first_in_slot_0
    try:
        together = run_many(eng, [req(eng, "Name a fruit.", max_tokens=12),
                                  req(eng, "Say hello.", bias={eng.tokenizer.encode(" dog")[0]: 5}, max_tokens=12)])
    finally:
        del sched._take_slot
    assert picked == [0]
    assert together[0][0] == alone and zebra not in together[0][0]


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "logit_bias token ids"), ({10**7: 1.0}, "logit_bias token ids"),
    ({5: 101.0}, "logit_bias values"), ({i: 1.0 for i in range(301)}, "at most 300"),
])
def test_bad_biases_are_refused(eng, bias, message):
    with pytest.raises(InvalidRequestError, match=message):
        eng.submit(req(eng, "hi", bias=bias), lambda out: None)


def test_a_bias_on_a_guided_request_with_the_served_drafter_stays_lossless(engine):
    """The served engine (hybrid drafter with the trained head, cost-aware K): a JSON-schema request
    with a bias gives the same tokens with speculation off and on, valid JSON, and the bias shows."""
    import json

    from specguide.request import GuidedDecodingParams

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                         "required": ["name", "age"], "additionalProperties": False})
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Alice is 30. Give her as JSON."}])

    def run(k, bias):
        r = Request(prompt=prompt, num_draft_tokens=k, guided=GuidedDecodingParams("json_schema", schema),
                    params=SamplingParams(max_tokens=40, temperature=0.0, logit_bias=bias))
        return run_alone(engine, r)

    plain, _, _ = run(0, {})
    bias = {plain[2]: -100.0}  # ban a token the plain answer writes early (the grammar may still need it)
    off, text_off, _ = run(0, bias)
    on, text_on, _ = run(None, bias)
    assert on == off and off != plain
    assert set(json.loads(text_on)) == {"name", "age"}
