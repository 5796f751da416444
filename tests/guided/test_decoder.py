"""GuidedDecoder mechanics with the real tokenizer and each grammar backend, driven by model-free logits."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import xgrammar as xgr

from specguide.guided import GuidedDecoder
from specguide.request import GuidedDecodingParams as G

from .conftest import VOCAB
from .helpers import (
    check_output,
    grammar_accepts,
    greedy_decode,
    load_guided_samples,
    output_text,
    target_logits,
)

K = 3
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def samples(service):
    return [(s, service.compile(s.params)) for s in load_guided_samples()]


@pytest.fixture
def schema_grammar(service):
    return service.compile(G("json_schema", json.dumps(SCHEMA)))


def test_masks_allow_exactly_the_grammar_valid_tokens(service, schema_grammar, hf_tokenizer):
    dec = GuidedDecoder(4, K, VOCAB)
    dec.add(2, schema_grammar)
    rng = random.Random(0)
    for prefix in ['', '{"name": "', '{"name": "Al", "age": 4', '{"name": "Al", "age": 4, "tags": ["a"']:
        dec.remove(2)
        dec.add(2, schema_grammar)
        ids = hf_tokenizer.encode(prefix, add_special_tokens=False)
        assert dec.advance_many(2, ids) == len(ids)
        dec.fill([(2, 1)])
        assert dec.token_mask.tolist() == [i == dec.row(2, 1) for i in range(dec.num_rows)]
        allowed = set(dec.allowed_tokens(2, 1).tolist())
        assert 0 < len(allowed) < VOCAB
        probe_ok = rng.sample(sorted(allowed), min(150, len(allowed)))
        probe_bad = rng.sample(sorted(set(range(VOCAB)) - allowed), 150)
        for tok in probe_ok + probe_bad:
            assert (dec.matchers[2].validate([tok]) == 1) == (tok in allowed), (prefix, tok)


def test_advance_and_rollback_keep_state_equal_to_a_fresh_matcher(schema_grammar, bonus):
    dec = GuidedDecoder(2, K, VOCAB)
    dec.add(0, schema_grammar)
    rng = random.Random(1)
    held: list[int] = []  # the tokens the matcher holds
    for step in range(120):
        if dec.is_terminated(0) or (dec.num_tokens(0) and rng.random() < 0.3):
            n = rng.randint(1, min(K + 1, dec.num_tokens(0)))
            dec.rollback(0, n)
            del held[len(held) - n:]
        else:
            dec.fill([(0, 0)])
            allowed = dec.allowed_tokens(0)
            weights = bonus[allowed].exp().numpy()
            tok = int(rng.choices(allowed.tolist(), weights=weights)[0])
            assert dec.advance(0, tok)
            held.append(tok)
            if not dec.is_terminated(0):
                dec.fill([(0, 0)])
                bad = int(rng.choice(np.setdiff1d(np.arange(VOCAB), dec.allowed_tokens(0)).tolist()))
                assert not dec.advance(0, bad)  # a rejected token leaves the state as it was
        assert dec.check_fresh(0, held) is None, (step, dec.check_fresh(0, held))


def test_unconstrained_rows_are_untouched(schema_grammar):
    dec = GuidedDecoder(3, K, VOCAB)
    dec.add(0, schema_grammar)
    dec.add(2, schema_grammar)
    rows = [(0, 0), (1, 0), (2, 0), (1, 2)]
    dec.fill([(0, 0), (1, 0), (2, 0)])  # slot 1 is unguided: stays unconstrained
    assert not dec.token_mask[dec.row(1, 0)]
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    dec.apply(logits, rows)
    assert torch.equal(logits[1], before[1]) and torch.equal(logits[3], before[3])
    for b in (0, 2):
        allowed = dec.allowed_tokens(rows[b][0])
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[allowed] = True
        assert torch.equal(logits[b][keep], before[b][keep])
        assert torch.isinf(logits[b][~keep]).all()
    dec.remove(0)
    assert dec.token_mask.tolist() == [r == dec.row(2, 0) for r in range(dec.num_rows)]
    plain = torch.randn(2, VOCAB)
    copy = plain.clone()
    dec.apply(plain, [(0, 0), (1, 1)])  # no constrained row: nothing happens
    assert torch.equal(plain, copy)


def test_apply_masks_logits_wider_than_the_vocab(schema_grammar):
    dec = GuidedDecoder(1, 0, VOCAB)
    dec.add(0, schema_grammar)
    dec.fill([(0, 0)])
    logits = torch.zeros(1, VOCAB + 64, dtype=torch.bfloat16)
    dec.apply(logits, [(0, 0)])
    assert torch.isinf(logits[0, VOCAB:]).all()
    assert set(torch.nonzero(logits[0] == 0).flatten().tolist()) == set(dec.allowed_tokens(0).tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_torch_apply_equals_xgrammar_kernel(schema_grammar, service, dtype):
    regex = service.compile(G("regex", "[0-9]{2}x"))
    dec = GuidedDecoder(3, K, VOCAB)
    dec.add(0, schema_grammar)
    dec.add(2, regex)
    assert dec.advance_many(2, [33]) == 1  # "1"
    dec.fill([(0, 1), (2, 0)])
    rows = [(0, 1), (1, 0), (2, 0), (0, 0)]
    idx = [dec.row(s, p) for s, p in rows]
    active = [b for b, r in enumerate(idx) if dec.token_mask[r]]
    for width in (VOCAB, VOCAB + 40):
        base = torch.randn(4, width).to(dtype)
        ours, ref = base.clone(), base.clone()
        dec.apply(ours, rows)
        xgr.apply_token_bitmask_inplace(ref, dec.bitmask[idx], vocab_size=VOCAB, indices=active)
        ref[active, VOCAB:] = float("-inf")  # ids past the tokenizer's vocabulary
        assert torch.equal(ours, ref)
        assert torch.equal(ours[1], base[1]) and torch.equal(ours[3], base[3])
        allowed = torch.isfinite(ours[2]).nonzero().flatten().tolist()
        assert allowed == dec.allowed_tokens(2).tolist() and 0 < len(allowed) < 100


def test_slot_bookkeeping(schema_grammar):
    dec = GuidedDecoder(2, K, VOCAB)
    assert dec.bitmask.shape == (2 * (K + 1), (VOCAB + 31) // 32) and dec.bitmask.dtype == torch.int32
    with pytest.raises(KeyError):
        dec.advance(0, 5)
    dec.add(0, schema_grammar)
    with pytest.raises(AssertionError):
        dec.add(0, schema_grammar)
    with pytest.raises(AssertionError):
        dec.fill([(0, 0), (0, 1)])  # one state, one row per fill
    with pytest.raises(AssertionError):
        dec.rollback(0, 1)
    dec.fill([(0, 0)])
    assert dec.advance(0, int(dec.allowed_tokens(0)[0])) and dec.num_tokens(0) == 1
    dec.remove(0)
    assert not dec.is_guided(0) and not dec.token_mask.any()
    dec.remove(1)  # freeing an unguided slot is a no-op


def test_generated_samples_are_accepted_and_valid(samples, hf_tokenizer, bonus, service):
    """Invariant 4 on every sample: guided greedy output ends by grammar, is accepted, and validates."""
    dec = GuidedDecoder(1, K, VOCAB)
    stop = service.stop_token_ids
    for i, (sample, grammar) in enumerate(samples):
        dec.add(0, grammar)
        tokens = greedy_decode(dec, 0, bonus, seed=i, check_every=25)
        assert dec.is_terminated(0), (sample.name, output_text(hf_tokenizer, tokens, stop))
        assert tokens[-1] in stop and grammar_accepts(grammar, tokens), sample.name
        check_output(sample, output_text(hf_tokenizer, tokens, stop))
        dec.remove(0)


def test_speculative_with_masked_drafts_equals_plain_greedy(samples, bonus, service):
    """One-model drafter flow: draft i uses mask row i, target rows 0..K reuse the same masks;
    after accepting a drafts the matcher is rolled back and fed the bonus token (invariant 1 and 3)."""
    picked = [(s, g) for s, g in samples if s.kind in ("json_schema", "ebnf", "regex")][:8]
    ref_dec, dec = GuidedDecoder(1, K, VOCAB), GuidedDecoder(2, K, VOCAB)
    rng = torch.Generator().manual_seed(7)
    total_drafts = total_accepted = 0
    for i, (sample, grammar) in enumerate(picked):
        ref_dec.add(0, grammar)
        ref = greedy_decode(ref_dec, 0, bonus, seed=i)
        ref_dec.remove(0)
        dec.add(1, grammar)
        out: list[int] = []
        while not dec.is_terminated(1) and len(out) < len(ref) + K + 1:
            drafts = []
            for p in range(K):  # drafter: a noisy copy of the target, masked by row p
                dec.fill([(1, p)])
                d_logits = (target_logits(bonus, i, out + drafts) + torch.rand(VOCAB, generator=rng) * 2.5)[None]
                dec.apply(d_logits, [(1, p)])
                drafts.append(int(d_logits.argmax()))
                assert dec.advance(1, drafts[-1])
                if dec.is_terminated(1):
                    break
            fed = len(drafts)
            if not dec.is_terminated(1):
                dec.fill([(1, fed)])
            rows = [(1, p) for p in range(fed + 1)]
            t_logits = torch.stack([target_logits(bonus, i, out + drafts[:p]) for p in range(fed + 1)])
            dec.apply(t_logits, rows)
            targets = t_logits.argmax(-1).tolist()
            a = 0
            while a < fed and drafts[a] == targets[a]:
                a += 1
            dec.rollback(1, fed - a)
            out += drafts[:a]
            total_drafts, total_accepted = total_drafts + fed, total_accepted + a
            if not dec.is_terminated(1):
                assert dec.advance(1, targets[a])
                out.append(targets[a])
            assert dec.check_fresh(1, out) is None, dec.check_fresh(1, out)
        assert out == ref, sample.name
        dec.remove(1)
    assert 0 < total_accepted < total_drafts  # both paths exercised


def test_fill_verify_rows_batch_equals_plain_greedy(samples, bonus, hf_tokenizer, service):
    """N-gram drafter flow, all slots in one batch: drafts known up front (some invalid), one call
    feeds them and fills rows 0..K per slot; outputs equal plain greedy; state == fresh matcher."""
    picked = [(s, g) for s, g in samples if s.kind in ("json_schema", "choice", "ebnf", "regex", "lark")][:12]
    n = len(picked)
    ref_dec = GuidedDecoder(1, K, VOCAB)
    refs = []
    for i, (_, grammar) in enumerate(picked):
        ref_dec.add(0, grammar)
        refs.append(greedy_decode(ref_dec, 0, bonus, seed=100 + i))
        ref_dec.remove(0)
    dec = GuidedDecoder(n + 1, K, VOCAB)  # slot n stays unguided and shares every batch
    for s, (_, grammar) in enumerate(picked):
        dec.add(s, grammar)
    outs: list[list[int]] = [[] for _ in range(n)]
    rng = random.Random(3)
    for _ in range(400):
        live = [s for s in range(n) if not dec.is_terminated(s)]
        if not live:
            break
        drafts = {}
        for s in live:  # the true continuation, corrupted at random (an n-gram drafter's guesses)
            d = refs[s][len(outs[s]): len(outs[s]) + K]
            drafts[s] = [t if rng.random() < 0.75 else rng.randrange(VOCAB) for t in d]
        drafts[n] = [5, 6, 7]
        fed = dec.fill_verify_rows(drafts)
        assert n not in fed
        rows = [(s, p) for s in live + [n] for p in range(K + 1)]
        logits = torch.stack([target_logits(bonus, 100 + s, outs[s] + drafts[s][:p]) if s < n else torch.zeros(VOCAB)
                              for s, p in rows])
        dec.apply(logits, rows)
        assert torch.equal(logits[-(K + 1):], torch.zeros(K + 1, VOCAB))  # unguided rows untouched
        targets = logits.argmax(-1).view(-1, K + 1).tolist()
        for j, s in enumerate(live):
            a = 0
            while a < len(drafts[s]) and drafts[s][a] == targets[j][a]:
                a += 1
                if drafts[s][a - 1] in service.stop_token_ids:
                    break  # the sequence ends at an accepted stop token
            assert a <= fed[s]  # an accepted draft was always fed to the grammar
            dec.rollback(s, fed[s] - a)
            outs[s] += drafts[s][:a]
            if not dec.is_terminated(s):
                assert dec.advance(s, targets[j][a])
                outs[s].append(targets[j][a])
            assert dec.check_fresh(s, outs[s]) is None, dec.check_fresh(s, outs[s])
    for s, (sample, grammar) in enumerate(picked):
        assert outs[s] == refs[s], sample.name
        assert grammar_accepts(grammar, outs[s])
        check_output(sample, output_text(hf_tokenizer, outs[s], service.stop_token_ids))


def test_structural_tag_constrains_the_body_after_its_trigger(samples, hf_tokenizer, bonus, service):
    import jsonschema

    sample, grammar = next((s, g) for s, g in samples if s.name == "trtllm_structural_tag_triggered_tags.json")
    tag = json.loads(sample.text)["format"]["tags"][0]
    dec = GuidedDecoder(1, K, VOCAB)
    dec.add(0, grammar)
    prefix = hf_tokenizer.encode("Let me check. " + tag["begin"], add_special_tokens=False)
    assert dec.advance_many(0, prefix) == len(prefix)
    tokens = prefix + greedy_decode(dec, 0, bonus, seed=5)
    assert dec.is_terminated(0) and grammar_accepts(grammar, tokens)
    text = output_text(hf_tokenizer, tokens, service.stop_token_ids)
    body = text.split(tag["begin"], 1)[1].split(tag["end"], 1)[0]
    jsonschema.validate(json.loads(body), tag["content"]["json_schema"])


def test_masks_apply_through_a_d2t_map_for_a_pruned_draft_vocabulary(schema_grammar):
    """A drafter with a pruned vocabulary (draft id j = target id d2t[j]) gets exactly the
    target mask's verdict for each of its ids."""
    dec = GuidedDecoder(1, K, VOCAB)
    dec.add(0, schema_grammar)
    dec.fill([(0, 0)])
    allowed_target = set(dec.allowed_tokens(0, 0).tolist())
    g = torch.Generator().manual_seed(0)
    d2t = torch.randperm(dec.vocab_size, generator=g)[:3000]  # a synthetic 3000-token draft vocabulary
    d2t = torch.cat([d2t, torch.tensor(sorted(allowed_target)[:5])])  # make sure some allowed ids are in it
    logits = torch.zeros(1, d2t.shape[0])
    dec.apply(logits, [(0, 0)], d2t=d2t)
    allowed_draft = {int(d2t[j]) for j in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert allowed_draft == {int(t) for t in d2t.tolist() if int(t) in allowed_target}
    assert allowed_draft  # some draft ids survive
    dec.remove(0)
