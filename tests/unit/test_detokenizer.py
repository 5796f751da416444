"""Incremental detokenizer: deltas add up to the full decode and never hold half a character."""
from __future__ import annotations

import random

import pytest

from specguide.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["héllo wörld — ünïcödé ✓", "数学は楽しい。漢字とかな", "emoji 🎉🚀👩‍👩‍👧 mix", "plain ascii text\n\twith tabs"]


@pytest.fixture(scope="module")
def tok():
    from specguide.models.loader import resolve_model_dir

    return Tokenizer(resolve_model_dir())


def _stream(tok, ids, chunk=1):
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(d.finish())
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_full_decode(tok, text, chunk):
    ids = tok.encode(text)
    deltas = _stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_random_token_streams(tok):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        deltas = _stream(tok, ids, rng.randrange(1, 4))
        assert "".join(deltas) == tok.decode(ids)


def test_multibyte_char_split_across_tokens_is_held_back(tok):
    # byte-level BPE splits a rare CJK/emoji char into byte tokens: no delta may end mid-character
    ids = tok.encode("🀄")
    assert len(ids) > 1
    d = IncrementalDetokenizer(tok)
    assert all(d.add([t]) == "" for t in ids[:-1])
    assert d.add(ids[-1:]) + d.finish() == "🀄"


def test_decode_is_the_fast_tokenizers_decode_without_clean_up(tok):
    """Tokenizer.decode calls the Rust tokenizer directly (the detokenizer's two decodes per step):
    the same text as transformers' decode with special tokens skipped and no clean-up, for random
    windows of any ids (special tokens and byte pieces included)."""
    rng = random.Random(1)
    special = sorted(tok.hf.all_special_ids)
    for _ in range(3000):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 16))]
        assert tok.decode(ids) == tok.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False), ids
