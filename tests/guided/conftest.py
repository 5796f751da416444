"""Fixtures for guided tests: the real SmolLM2 tokenizer and one compile service per session."""
from __future__ import annotations

import pytest

from specguide.guided import GrammarCompilerService
from specguide.models.loader import resolve_model_dir

from .helpers import token_bonus

VOCAB = 49152  # SmolLM2's logits width (== its tokenizer's vocabulary)


@pytest.fixture(scope="session")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_dir()))


@pytest.fixture(scope="session")
def service(hf_tokenizer):
    svc = GrammarCompilerService(hf_tokenizer, VOCAB, max_workers=2, cache_limit_bytes=256 << 20)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session")
def bonus(hf_tokenizer, service):
    return token_bonus(hf_tokenizer, VOCAB, service.stop_token_ids)
