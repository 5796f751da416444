"""Fixtures for engine tests: the real SmolLM2 (default model) and a transformers reference."""
from __future__ import annotations

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine import Engine
from specguide.models.loader import resolve_model_dir

from ..guided.helpers import save_random_head

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def random_head(tmp_path_factory, engine):
    """An untrained head over a pruned vocabulary (every 3rd id): lossless whatever it proposes."""
    return save_random_head(tmp_path_factory.mktemp("head") / "random.pt", engine.model.cfg)


@pytest.fixture(scope="session")
def engine():
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64))
    yield eng
    eng.shutdown()
    assert not eng._thread.is_alive()


def run_alone(engine: Engine, request):
    """All events of one request; returns (token ids, text, final event)."""
    outs = list(engine.generate(request))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1]
