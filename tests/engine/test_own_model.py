"""Serving your own model (docs/own-model.md): a copy of the model repository whose
config.pbtxt names another checkpoint; `scripts/train_draft_head.py --model-repository DIR` (what
`make serve MODEL_REPOSITORY=DIR` runs) trains that model's head where the server looks for it, and
an engine built from the same config.pbtxt drafts with it, losslessly. Two checkpoints in folders of
one name get a head each.

The checkpoint is a small random Llama with the default model's tokenizer and chat template."""
from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams
from specguide.speculative.draft_head import DraftHead, default_head_path
from specguide.triton.interfaces import engine_parameters

from ..integration.conftest import repository_with
from .test_guided_engine import run_many

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array",
                     "items": {"type": "string"}}}, "required": ["id", "tags"]})


def make_checkpoint(folder: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A 2-layer random Llama (hidden 64) saved with `tokenizer_dir`'s tokenizer files."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    tf.LlamaForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


def train_script():
    spec = importlib.util.spec_from_file_location("train_draft_head", ROOT / "scripts" / "train_draft_head.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def own_model(tmp_path_factory, model_dir):
    """(repository, checkpoint, a second checkpoint in a folder of the same name, the trained head);
    the model cache is a fresh folder of the test's own."""
    tmp = tmp_path_factory.mktemp("own_model")
    mine = make_checkpoint(tmp / "a" / "hf", model_dir, seed=0)
    other = make_checkpoint(tmp / "b" / "hf", model_dir, seed=1)
    repo = repository_with(tmp, {"model_dir": str(mine)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECGUIDE_CACHE_DIR", str(tmp / "cache"))
        script = train_script()
        assert script.main(["--model-repository", str(repo), "--quick", "--if-missing"]) == 0
        head = default_head_path(mine)
        assert head.exists() and head.parent == tmp / "cache" / "draft_heads"
        mtime = head.stat().st_mtime_ns
        assert script.main(["--model-repository", str(repo), "--quick", "--if-missing"]) == 0
        assert head.stat().st_mtime_ns == mtime  # found, not trained again
        yield repo, mine, other, head


def test_the_repositorys_config_is_what_the_script_and_the_engine_read(own_model):
    repo, mine, _, _ = own_model
    params = engine_parameters(repo)
    assert params["model_dir"] == str(mine) and params["drafter"] == "hybrid"
    shipped = engine_parameters(ROOT / "model_repository")
    assert set(shipped) == set(params) and shipped["model_dir"] == ""
    fields = set(EngineConfig.__dataclass_fields__)
    assert set(shipped) <= fields, set(shipped) - fields  # a misspelt setting would be ignored silently
    assert EngineConfig.from_parameters(params).model_dir == str(mine)


def test_the_head_is_trained_for_the_served_model_and_only_found_for_it(own_model, monkeypatch):
    repo, mine, other, head = own_model
    monkeypatch.setenv("SPECGUIDE_CACHE_DIR", str(head.parents[1]))
    assert default_head_path(other) != head and default_head_path(mine) == head  # same folder name "hf"
    assert not default_head_path(other).exists()
    served = EngineConfig.from_parameters(engine_parameters(repo))
    small = dict(max_slots=2, max_seq_len=512, adaptive_k=False, cost_aware_k=False)
    eng = Engine(replace(served, **small))
    try:
        assert eng.core.head_drafter is not None and eng.core.drafter == "hybrid"
        assert DraftHead.load(head, eng.core.model).meta["model"] == str(mine)
        assert eng.core.model.cfg.hidden_size == 64
        tok = eng.tokenizer

        def requests(k: int) -> list[Request]:
            return [Request(prompt=tok.apply_chat_template([{"role": "user", "content": m}]), num_draft_tokens=k,
                            guided=GuidedDecodingParams("json_schema", SCHEMA) if i % 2 == 0 else None,
                            params=SamplingParams(max_tokens=40, temperature=0.0))
                    for i, m in enumerate(["Tag a photo.", "Say hi.", "A record, please.", "Count to five."])]
        off = [(toks, f.finish_reason) for toks, _, f in run_many(eng, requests(0))]
        runs = run_many(eng, requests(3))
        assert [(toks, f.finish_reason) for toks, _, f in runs] == off  # lossless
        assert sum(f.total_draft_tokens for _, _, f in runs) > 0
    finally:
        eng.shutdown()
    eng = Engine(replace(served, **small, model_dir=str(other)))
    try:  # the other "hf" has no head of its own: no drafting with one trained for another model
        assert eng.core.head_drafter is None and eng.core.drafter == "grammar"
    finally:
        eng.shutdown()


def test_a_max_seq_len_past_the_models_positions_is_refused(own_model, tmp_path):
    """max_seq_len beyond config.json's max_position_embeddings (RoPE past its trained range) is a
    configuration error naming both, not a model that decodes noise on long prompts."""
    _, mine, _, _ = own_model
    folder = shutil.copytree(mine, tmp_path / "short")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 256}))
    with pytest.raises(ValueError, match="max_seq_len 512 exceeds short's max_position_embeddings 256"):
        Engine(EngineConfig(model_dir=str(folder), max_slots=1, max_seq_len=512))
    Engine(EngineConfig(model_dir=str(folder), max_slots=1, max_seq_len=256)).shutdown()


def test_a_base_model_without_a_chat_template_gets_its_training_prompts_plain(own_model, tmp_path):
    """A base checkpoint (no chat template): the training prompts are the messages themselves, and the
    corpus is made (apply_chat_template would raise)."""
    from specguide.training.train_head import TrainConfig, generate_corpus

    _, mine, _, _ = own_model
    folder = shutil.copytree(mine, tmp_path / "base", ignore=shutil.ignore_patterns("chat_template.jinja"))
    eng = Engine(EngineConfig(model_dir=str(folder), max_slots=2, max_seq_len=1024, drafter="grammar"))
    try:
        assert not eng.tokenizer.hf.chat_template
        samples = generate_corpus(eng, TrainConfig(num_schemas=2, schema_variants=1, num_chat=2, max_tokens_json=12,
                                                   max_tokens_chat=8))
        prompts = [eng.tokenizer.hf.decode(s.tokens[: s.prompt_len]) for s in samples]
    finally:
        eng.shutdown()
    assert len(samples) == 4, prompts
    assert sum(p.startswith("Generate a JSON object") for p in prompts) == 2 and all(p.endswith("\n") for p in prompts)
    assert not any("<|im_start|>" in p for p in prompts)


def test_generation_configs_end_of_turn_ids_end_the_answer(own_model, tmp_path):
    """generation_config.json's eos_token_id list (where Llama 3 / Qwen2.5 / Gemma 3 instruct models
    keep their end-of-turn ids) ends an answer like config.json's EOS does."""
    from .conftest import run_alone

    _, mine, _, _ = own_model

    def answer(folder):
        eng = Engine(EngineConfig(model_dir=str(folder), max_slots=1, max_seq_len=256, num_draft_tokens=0))
        try:
            return eng.core.eos_token_ids, run_alone(eng, Request(prompt="Count: one two", params=SamplingParams(
                max_tokens=12, temperature=0.0)))
        finally:
            eng.shutdown()
    eos, (toks, _, final) = answer(mine)
    assert final.finish_reason == "length" and not eos & set(toks)
    i = max(i for i in range(len(toks)) if toks[i] not in toks[:i])  # the latest token not seen before it
    folder = shutil.copytree(mine, tmp_path / "instruct")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, toks[i]]}))
    eos2, (toks2, _, final2) = answer(folder)
    # the answer ends at that id (included in the output ids, as config.json's EOS is)
    assert eos2 == eos | {toks[i]} and final2.finish_reason == "stop" and toks2 == toks[: i + 1], (toks, toks2)
