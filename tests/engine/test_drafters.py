"""Issue 8's drafters on the real SmolLM2 and real xgrammar: grammar-forced (jump-forward) drafts,
the trained EAGLE-style head, the hybrid, adaptive K. Greedy output with each drafter equals
speculation off, token for token, guided and unguided."""
from __future__ import annotations

import dataclasses
import random

import pytest

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import Request, SamplingParams
from specguide.speculative.step_cost import StepCosts
from specguide.guided.decoder import GuidedDecoder
from specguide.training.train_head import TrainConfig, run

from ..guided.helpers import load_guided_samples
from .conftest import run_alone
from .test_guided_engine import run_many
from .test_speculative import requests


def outputs(engine, reqs):
    """[(finish reason, token ids)] and the final events."""
    runs = run_many(engine, reqs)
    return [(final.finish_reason, toks) for toks, _, final in runs], [final for _, _, final in runs]


@pytest.mark.parametrize("drafter", ["grammar", "head", "hybrid"])
def test_greedy_with_each_drafter_equals_speculation_off(engine, random_head, drafter):
    reqs = lambda k: requests(engine, lambda i: k, max_tokens=40)  # noqa: E731
    off, _ = outputs(engine, reqs(0))
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter=drafter,
                              draft_head_path=str(random_head), cost_aware_k=False))  # every step drafts
    try:
        assert eng.core.drafter == drafter
        got, finals = outputs(eng, reqs(3))
        assert got == off
        drafted = sum(f.total_draft_tokens for f in finals)
        accepted = sum(f.total_accepted_draft_tokens for f in finals)
        assert drafted > 0 and accepted > 0, (drafted, accepted)  # forced JSON punctuation is accepted
        for s in range(8):
            assert not eng.core.guided.is_guided(s)
    finally:
        eng.shutdown()


class _Behind:
    """What the head's catch-up reads of a sequence: its slot and tokens."""

    def __init__(self, slot: int, ids: list[int]):
        self.slot, self.ids = slot, ids

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def tokens(self, a: int, b: int) -> list[int]:
        return self.ids[a:b]


def test_the_heads_catch_up_takes_every_slot_behind_in_one_forward_with_the_rows_slot_by_slot_gives(
        engine, monkeypatch):
    """Slots behind catch up together, in forwards of as many rows as the nearest has left (at most
    `chunk`); the head's cache rows are, bit for bit, those of catching up one slot at a time."""
    import torch

    from specguide.speculative.head_drafter import HeadDrafter

    head = engine.core.head_drafter.head
    together, alone = (HeadDrafter(head, max_slots=4, max_seq_len=256, K=3, chunk=32, device=torch.device("cpu"))
                       for _ in range(2))
    rng = random.Random(0)
    seqs = [_Behind(slot, [rng.randrange(head.target.cfg.vocab_size) for _ in range(n)])
            for slot, n in enumerate((3, 41, 42, 120))]  # (3: nothing to catch up)
    gen = torch.Generator().manual_seed(0)
    for d in (together, alone):
        for s in seqs:  # the target's features the head reads, the same in both
            hidden = torch.randn(1, s.num_tokens, head.cfg.hidden_size, generator=gen.manual_seed(s.slot))
            d.record(torch.tensor([s.slot]), torch.arange(s.num_tokens)[None], hidden)
    calls: list[int] = []
    run_ = HeadDrafter._run
    monkeypatch.setattr(HeadDrafter, "_run", lambda self, slots, *a: (calls.append(len(slots)), run_(self, slots, *a))[1])
    with torch.inference_mode():
        together._catch_up(seqs)
        n_together = list(calls)
        calls.clear()
        for s in seqs:
            alone._catch_up([s])
    # 3 slots behind by 36, 37 and 115 rows (K+1 rows left for the step): 32 rows each, then 4 each,
    # 1 for the last two, then the last one's 32 + 32 + 14; one at a time: 2 + 2 + 4 forwards
    assert n_together == [3, 3, 2, 1, 1, 1] and calls == [1] * 8
    assert together.cached == alone.cached == [0, 36, 37, 115]
    for s in seqs:  # every block of every slot (block 0, no slot's, is scratch)
        blocks = together.kv.table[s.slot].long()
        assert torch.equal(together.kv.k[:, blocks], alone.kv.k[:, blocks])
        assert torch.equal(together.kv.v[:, blocks], alone.kv.v[:, blocks])
    assert together.kv.k[:, 1:].abs().sum() > 0  # (rows were written)


def test_cost_aware_k_is_lossless_and_measured(engine, random_head):
    """cost_aware_k: whether a step drafts follows measured step times (batch 1: one request at a
    time; then all together); greedy output still equals speculation off."""
    reqs = lambda k: requests(engine, lambda i: k, max_tokens=40)  # noqa: E731
    off, _ = outputs(engine, reqs(0))
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter="hybrid",
                              draft_head_path=str(random_head), cost_aware_k=True))
    try:
        one_by_one = [outputs(eng, [r])[0][0] for r in reqs(3)[:3]]
        assert one_by_one == off[:3]
        got, finals = outputs(eng, reqs(3))
        assert got == off
        measured = eng.core.proposer.step_costs.seconds
        assert {(1, 0), (1, 3)} <= set(measured), measured  # a lone slot explored drafting and plain
        assert all(t > 0 for t in measured.values())
        assert sum(f.total_draft_tokens for f in finals) > 0
        # a seeded sampled request: the speculation-off tokens, whatever K the measurements picked
        seeded = SamplingParams(max_tokens=64, temperature=1.3, seed=5, ignore_eos=True)
        prompt = reqs(0)[1].prompt
        want = run_alone(engine, Request(prompt=prompt, params=seeded, num_draft_tokens=0))[0]
        assert [run_alone(eng, Request(prompt=prompt, params=seeded))[0] for _ in range(3)] == [want] * 3
    finally:
        eng.shutdown()


def test_missing_head_falls_back_to_grammar_drafter(tmp_path):
    eng = Engine(EngineConfig(max_slots=2, max_seq_len=256, drafter="hybrid", warmup=False,
                              draft_head_path=str(tmp_path / "none.pt")))
    try:
        assert eng.core.drafter == "grammar" and eng.core.head_drafter is None
    finally:
        eng.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_forced_tokens_are_always_accepted_by_the_matcher(engine, backend):
    """Walk every JSON/regex/EBNF sample grammar; at each state the jump-forward tokens are
    accepted in order by a fresh matcher fed the history, and the slot's matcher is untouched.
    They spell a prefix of the jump-forward string without its trailing whitespace (the model
    fuses that to the next word: `": "` + ` true`; xgrammar). llguidance drafts its fast-forward tokens."""
    dec = GuidedDecoder(1, 3, engine.core.runner.vocab_size)
    checked = proposed = trailing = 0
    for sample in load_guided_samples():
        if sample.kind not in ("json_schema", "regex", "ebnf"):
            continue
        try:
            compiled = engine.core.compiler.compile(dataclasses.replace(sample.params, backend=backend))
        except Exception:
            continue  # unsupported samples are covered by the compile tests
        dec.add(0, compiled)
        fed: list[int] = []  # the tokens the slot's matcher holds
        for _ in range(40):
            if dec.is_terminated(0):
                break
            before = dec.num_tokens(0)
            assert compiled.backend == backend
            raw = dec._matcher(0).m.find_jump_forward_string() if backend == "xgrammar" else None
            forced = dec.forced_tokens(0, engine.tokenizer.encode, 8)
            assert dec.num_tokens(0) == before
            text = engine.tokenizer.hf.decode(forced)
            if raw is not None:
                assert raw.rstrip().startswith(text) and text == text.rstrip(), (raw, text)
                trailing += raw != raw.rstrip()
            fresh = compiled.matcher()
            assert dec.num_tokens(0) == len(fed) and all(fresh.accept(t) for t in fed + forced)
            checked += 1
            proposed += len(forced)
            if forced:
                assert dec.advance_many(0, forced) == len(forced)
                fed += forced
            else:  # take an allowed token: the first one that is not a stop token
                dec.fill([(0, 0)])
                allowed = [t for t in dec.allowed_tokens(0).tolist() if t not in engine.core.eos_token_ids][:1]
                if not allowed:
                    break
                assert dec.advance(0, allowed[0])
                fed.append(allowed[0])
        dec.remove(0)
    assert checked > 100 and proposed > 50 and (trailing > 5 or backend == "llguidance"), (checked, proposed, trailing)


def test_adaptive_k_shrinks_with_low_acceptance(engine):
    eng = engine
    req = requests(eng, lambda i: 3)[0]
    s = eng.core.make_sequence(req, lambda o: None)
    s.slot = 0
    eng.core.proposer.accept_rate[0] = 1.0
    assert eng.core.proposer.budget(s) == 3
    eng.core.proposer.accept_rate[0] = 0.5
    assert eng.core.proposer.budget(s) == 2  # 0.5, 0.25 >= 0.15 > 0.125
    eng.core.proposer.accept_rate[0] = 0.2
    assert eng.core.proposer.budget(s) == 1
    eng.core.proposer.accept_rate[0] = 1.0


def test_each_kind_keeps_its_recent_acceptance_and_a_new_sequence_starts_from_its_kinds(engine):
    """Chat drafts are mostly rejected, JSON ones mostly accepted: each kind's recent acceptance is
    kept apart, and a new sequence starts from its kind's (a chat request does not verify, nor have
    the draft head catch its prompt up, at its first steps)."""
    p = engine.core.proposer
    saved = dict(p.accept_prior), list(p.slot_guided), list(p.accept_rate), dict(p.prior_judged), list(p.judged)
    guided, chat = requests(engine, lambda i: 3)[:2]  # prompts() alternates guided, unguided
    assert chat.guided is None and guided.guided is not None
    chat_seq = engine.core.make_sequence(chat, lambda o: None)
    try:
        p.accept_prior.update({False: 1.0, True: 1.0})
        p.admit(0, chat_seq)
        assert p.accept_rate[0] == 1.0
        for _ in range(20):
            p.observe(0, 3, 0)  # its drafts rejected
        assert p.accept_prior[False] < 0.15 and p.accept_prior[True] == 1.0
        chat_seq.slot = 1
        p.admit(1, chat_seq)
        assert p.accept_rate[1] == p.accept_prior[False] and p.budget(chat_seq) == 1
    finally:
        p.accept_prior.clear(), p.accept_prior.update(saved[0])
        p.slot_guided[:], p.accept_rate[:] = saved[1], saved[2]
        p.prior_judged.clear(), p.prior_judged.update(saved[3])
        p.judged[:] = saved[4]


def test_a_recurring_ngram_counts_as_sure_drafts(engine):
    """sure_ngram: what followed the latest earlier occurrence of the last 4 tokens (what the n-gram
    drafters propose), indexed as the sequence grows, across the prompt / output boundary."""
    p = engine.core.proposer
    saved = dict(p.accept_prior), list(p.accept_rate)
    s = engine.core.make_sequence(Request(prompt="x", num_draft_tokens=3), lambda o: None)
    try:
        s.prompt_ids = [5, 6, 7, 8, 9, 1, 2, 3]
        s.slot = 0
        p.admit(0, s)
        assert p.sure_ngram(s, 3) == 0  # 2 3 ... : the last 4 tokens have not occurred before
        s.output_ids += [5, 6, 7]
        assert p.sure_ngram(s, 3) == 0
        s.output_ids += [8]  # 5 6 7 8 occurred at 0..3: 9 1 2 follow
        assert p.sure_ngram(s, 3) == 3 and p.sure_ngram(s, 2) == 2
        assert p.sure_ngram(s, 3) == p.ngram.chain(s.prompt_ids + s.output_ids, [], 3, 3)[0].__len__()
        s.output_ids += [4]  # 6 7 8 4: new
        assert p.sure_ngram(s, 3) == 0
        s.output_ids += [5, 6, 7, 8]  # latest earlier occurrence: the output's 5 6 7 8, then 4 5 6
        assert p.sure_ngram(s, 3) == 3
        s.output_ids += [4, 5, 6]  # 8 4 5 6 occurred at 11..14: 7 8 4 follow
        assert p.sure_ngram(s, 3) == 3
        # an unguided slot's sure drafts are what forced() gives cost_aware_k (the served engine's)
        assert p.step_costs is not None and p.forced(s) == p.sure_ngram(s, 3)
        p.admit(0, s)  # a new sequence in the slot: a new index, the same answer
        assert p.sure_ngram(s, 3) == 3
    finally:
        p.accept_prior.clear(), p.accept_prior.update(saved[0])
        p.accept_rate[:] = saved[1]


def test_a_repetitive_prompt_drafts_when_chat_drafts_are_rarely_accepted(engine):
    """With the unguided acceptance estimate low (chat), a new sequence starts there and drafts
    nothing it is unsure of, but a repetitive prompt's recurring n-grams still get verified at once
    and accepted (the n-gram continuation is what the model says)."""
    p = engine.core.proposer
    saved = dict(p.accept_prior), p.step_costs
    try:
        p.accept_prior[False] = 0.05
        # measured: a verification costs 3.6x a plain step (only 4 sure tokens repay it), no probes
        p.step_costs = StepCosts(seconds={(1, 0): 0.005, (1, 1): 0.018, (1, 2): 0.018, (1, 3): 0.018},
                                 next_probe={1: (10**9, 128)})
        prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"
        toks, _, final = run_alone(engine, Request(prompt=prompt, num_draft_tokens=3,
                                                   params=SamplingParams(max_tokens=24, temperature=0.0)))
        assert final.total_accepted_draft_tokens > 0, final
        steps = final.num_output_tokens - 1 - final.total_accepted_draft_tokens
        assert steps < len(toks) - 1
    finally:
        p.accept_prior.clear(), p.accept_prior.update(saved[0])
        p.step_costs = saved[1]


def test_grammar_forced_drafts_set_a_floor_under_k_and_stay_out_of_the_acceptance_estimate(engine):
    p = engine.core.proposer
    saved = dict(p.accept_prior), list(p.accept_rate), dict(p.prior_judged), list(p.judged)
    s = engine.core.make_sequence(requests(engine, lambda i: 3)[1], lambda o: None)  # unguided
    s.slot = 0
    try:
        p.accept_rate[0], p.judged[0] = 0.2, 1.0
        assert p.budget(s) == 1 and p.budget(s, forced=3) == 3  # forced tokens are not cut by adaptive K
        p.observe(0, drafted=3, accepted=2, forced=2)  # the free draft was rejected (1 judged, 0 accepted)
        assert p.accept_rate[0] == pytest.approx(0.7 * 0.2)
        p.observe(0, drafted=2, accepted=2, forced=2)  # forced drafts alone: nothing learned
        assert p.accept_rate[0] == pytest.approx(0.7 * 0.2)
    finally:
        p.accept_prior.clear(), p.accept_prior.update(saved[0])
        p.accept_rate[:] = saved[1]
        p.prior_judged.clear(), p.prior_judged.update(saved[2])
        p.judged[:] = saved[3]


def test_the_acceptance_estimate_is_the_chance_a_draft_is_accepted_after_accepted_ones(engine):
    """Verifications of 3 drafts, each accepted with p = 0.7 when the ones before it were: the slot's
    and its kind's estimates find p (what the step cost's geometric sum and adaptive K take), not
    accepted / drafted (0.51, which kept K at 2 and had cost_aware_k stop drafting where it paid)."""
    p = engine.core.proposer
    saved = dict(p.accept_prior), dict(p.prior_judged), list(p.accept_rate), list(p.judged), list(p.slot_guided)
    s = engine.core.make_sequence(requests(engine, lambda i: 3)[1], lambda o: None)
    s.slot = 0
    rng = random.Random(0)
    try:
        p.slot_guided[0] = False
        p.accept_rate[0], p.accept_prior[False] = 0.3, 0.3
        drafted = accepted = 0
        slot_rates, prior_rates = [], []
        for _ in range(4000):
            n = next((i for i in range(3) if rng.random() >= 0.7), 3)  # drafts accepted before the first rejection
            p.observe(0, 3, n)
            drafted, accepted = drafted + 3, accepted + n
            slot_rates.append(p.accept_rate[0])
            prior_rates.append(p.accept_prior[False])
        assert accepted / drafted == pytest.approx(0.51, abs=0.02)  # what the old estimate was
        # moving ratios (decay 0.7 a slot, 0.9 its kind) follow the recent verifications: p on average
        assert sum(slot_rates[100:]) / 3900 == pytest.approx(0.7, abs=0.03)
        assert sum(prior_rates[100:]) / 3900 == pytest.approx(0.7, abs=0.03)
        p.accept_rate[0] = 0.7
        assert p.budget(s) == 3  # 0.7 ** 4 = 0.24 >= 0.15: three drafts
    finally:
        p.accept_prior.clear(), p.accept_prior.update(saved[0])
        p.prior_judged.clear(), p.prior_judged.update(saved[1])
        p.accept_rate[:], p.judged[:], p.slot_guided[:] = saved[2], saved[3], saved[4]


def test_tiny_trained_head_beats_chance_and_runs_in_the_step(engine, tmp_path):
    """A one-epoch self-distillation on a few prompts: the head agrees with the target far more
    often than chance and than an untrained head, loads from disk and drafts inside the step
    (accepting drafts) without changing greedy output."""
    schemas = [s.text for s in load_guided_samples() if s.kind == "json_schema"
               and "unsupported" not in s.name][:6]
    cfg = TrainConfig(seed=0, epochs=2, num_schemas=6, num_subschemas=4, num_chat=6, max_tokens_json=48,
                      max_tokens_chat=32, draft_vocab=4096, depth=2, val_fraction=0.25)
    head, report, _ = run(cfg, engine=engine, schemas=schemas)
    assert report.samples >= 20 and report.vocab_coverage > 0.9
    chance = 1.0 / head.draft_vocab_size
    assert report.val_accuracy[0] > 50 * chance, report.val_accuracy
    assert report.val_accuracy[0] > 0.05, report.val_accuracy
    path = tmp_path / "tiny.pt"
    head.save(path, {"report": report.val_accuracy})
    reqs = lambda k: requests(engine, lambda i: k, max_tokens=32)  # noqa: E731
    off, _ = outputs(engine, reqs(0))
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, num_draft_tokens=3, drafter="head",
                              draft_head_path=str(path), adaptive_k=False))
    try:
        assert eng.core.head_drafter is not None and eng.core.head_drafter.head.draft_vocab_size == 4096
        got, finals = outputs(eng, reqs(3))
        assert got == off
        accepted = sum(f.total_accepted_draft_tokens for f in finals)
        drafted = sum(f.total_draft_tokens for f in finals)
        assert accepted / drafted > 0.05, (accepted, drafted)
    finally:
        eng.shutdown()
