"""Fixtures for guided tests: the real SmolLM2 tokenizer and one compile service per grammar backend."""
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


def _compile_service(hf_tokenizer, backend: str):
    svc = GrammarCompilerService(hf_tokenizer, VOCAB, max_workers=2, cache_limit_bytes=256 << 20,
                                 default_backend=backend)
    yield svc
    svc.shutdown()


@pytest.fixture(scope="session", params=["xgrammar", "llguidance"])
def service(request, hf_tokenizer):
    """One compile service per grammar backend (its default); every test using it runs for both."""
    yield from _compile_service(hf_tokenizer, request.param)


@pytest.fixture(scope="session")
def xgr_service(hf_tokenizer):
    """xgrammar only (its own error messages, cache)."""
    yield from _compile_service(hf_tokenizer, "xgrammar")


@pytest.fixture(scope="session")
def served_service(hf_tokenizer):
    """The grammar service as served (`guided_backend` auto: llguidance for JSON schemas)."""
    yield from _compile_service(hf_tokenizer, "auto")


@pytest.fixture(scope="session")
def bonus(hf_tokenizer, service):
    return token_bonus(hf_tokenizer, VOCAB, service.stop_token_ids)
