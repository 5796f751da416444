"""LoRA adapters (models/lora.py, engine/lora_adapters.py) on the real SmolLM2 against `peft` on
`transformers`: random adapters made here (rank 8 and 16), logits close in fp32 and greedy text
equal; rows with different adapters or none in one batch each as alone; prefix blocks never shared
across adapters; at most max_loras resident; adapters this model cannot use refused by name."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.kv_cache import KVCache
from specguide.engine.loop import Engine
from specguide.models.loader import load_model
from specguide.models.lora import AdapterError, LoRABank, load_adapter
from specguide.request import InvalidRequestError, Request, SamplingParams

from ..lora_helpers import SPECS, make_adapters, peft_greedy
from .conftest import PROMPTS, run_alone


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    """{name: folder} of PEFT adapters saved by peft, and the peft model holding them (float32)."""
    return make_adapters(model_dir, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def ours(model_dir):
    return load_model(model_dir, torch.float32)


def _logits(model, kv, ids: list[int], slot: int) -> torch.Tensor:
    positions = torch.arange(len(ids))[None]
    ctx = model.make_context(torch.tensor([slot]), positions, [slot], len(ids))
    return model.logits(model(torch.tensor([ids]), ctx, kv))[0]


@torch.inference_mode()
@pytest.mark.parametrize("path", ["c_stack", "torch"])
def test_an_adapters_logits_are_peft_s_and_the_base_rows_keep_their_bits(ours, adapters, model_dir, path):
    from transformers import AutoTokenizer

    folders, pm = adapters
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPTS[0])
    bank = LoRABank(ours.cfg, 4, 2)
    for i, name in enumerate(SPECS):
        bank.place(i, load_adapter(name, folders[name], ours.cfg))
    kv = KVCache(30, 4, 3, 128, 64, torch.float32)
    fused = ours.fused
    ours.lora = bank
    try:
        if path == "torch":
            ours.fused = None
        base = _logits(ours, kv, ids, 0)
        for i, name in enumerate(SPECS):
            pm.set_adapter(name)
            want = pm(torch.tensor([ids])).logits[0]
            bank.bind(i + 1, i)
            got = _logits(ours, kv, ids, i + 1)
            assert (got - want).abs().max().item() < 1e-3, name
            assert (got - base).abs().max().item() > 0.1, name  # the adapter does change the logits
            assert torch.equal(_logits(ours, kv, ids, 0), base)  # a row without one: the same bits
    finally:
        ours.fused, ours.lora = fused, None


@torch.inference_mode()
def test_rows_with_different_adapters_in_one_forward_each_have_their_own_bits(ours, adapters):
    """One C-stack forward of three rows (adapter a, none, adapter b) gives each row the bits it
    has alone: the adapters' products are per row (batch invariance holds with adapters)."""
    folders, _ = adapters
    bank = LoRABank(ours.cfg, 4, 2)
    for i, name in enumerate(SPECS):
        bank.place(i, load_adapter(name, folders[name], ours.cfg))
    ours.lora = bank
    try:
        ids = list(range(100, 120))
        kv = KVCache(30, 4, 3, 128, 64, torch.float32)
        for row, index in ((0, 0), (1, -1), (2, 1)):
            bank.bind(row, index)
        alone = [_logits(ours, kv, ids, row) for row in range(3)]
        ctx = ours.make_context(torch.tensor([0, 1, 2]), torch.arange(20)[None].repeat(3, 1), [0, 1, 2], 20)
        together = ours.logits(ours(torch.tensor([ids] * 3), ctx, kv))
        for row in range(3):
            assert torch.equal(together[row], alone[row]), row
        assert not torch.equal(alone[0], alone[1]) and not torch.equal(alone[2], alone[1])
    finally:
        ours.lora = None


@pytest.fixture(scope="module")
def lora_engine(adapters):
    """The float32 engine serving both adapters (lora_adapters inline), one resident at a time."""
    folders, _ = adapters
    eng = Engine(EngineConfig(max_slots=8, max_seq_len=512, prefill_chunk=64, weight_dtype="float32",
                              activation_dtype="float32", max_loras=1,
                              lora_adapters=json.dumps({k: str(v) for k, v in folders.items()})))
    yield eng
    eng.shutdown()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@torch.inference_mode()
def test_greedy_text_with_an_adapter_is_peft_s_with_speculation_on_and_off(lora_engine, adapters):
    _, pm = adapters
    engine = lora_engine
    for name, prompt in (("support", PROMPTS[0]), ("legal", PROMPTS[2])):
        ids = engine.tokenizer.encode(prompt)
        want, base = peft_greedy(pm, name, ids, 24), peft_greedy(pm, None, ids, 24)
        assert want != base
        for k in (None, 0):
            toks, _, final = run_alone(engine, Request(prompt_ids=ids, params=_greedy(24), lora_name=name,
                                                       num_draft_tokens=k))
            assert toks == want, (name, k)
        toks, _, _ = run_alone(engine, Request(prompt_ids=ids, params=_greedy(24)))
        assert toks == base


def test_requests_with_two_adapters_and_none_at_once_each_get_their_alone_output(lora_engine):
    """max_loras 1: the second adapter waits until the first is idle, then takes its place."""
    engine = lora_engine
    reqs = [Request(prompt=PROMPTS[i % 3], params=_greedy(20 + i), lora_name=name)
            for i, name in enumerate(["support", None, "legal", "support", None, "legal"])]
    alone = [run_alone(engine, r)[0] for r in reqs]
    loads = engine.core.adapters.loads
    results: dict[int, list[int]] = {}
    done = threading.Event()

    def cb_for(i):
        def cb(out):
            results.setdefault(i, []).extend(out.token_ids)
            if out.finished:
                assert out.error is None, out.error
                if len(results) == len(reqs) and all(len(results[j]) == 20 + j for j in results):
                    done.set()
        return cb

    for i, r in enumerate(reqs):
        engine.submit(r, cb_for(i))
    assert done.wait(300)
    assert [results[i] for i in range(len(reqs))] == alone
    assert engine.core.adapters.loads > loads  # the two adapters took turns in the one place
    assert engine.core.adapters.stats()["lora_adapters_resident"] == 1


def test_prefix_blocks_are_never_shared_across_adapters(lora_engine):
    engine = lora_engine
    prompt = " ".join(PROMPTS[3:4] * 6)  # several full blocks
    base = run_alone(engine, Request(prompt=prompt, params=_greedy(8)))
    with_a = run_alone(engine, Request(prompt=prompt, params=_greedy(8), lora_name="support"))
    assert with_a[2].num_cached_tokens == 0  # the base model's blocks are not the adapter's
    again = run_alone(engine, Request(prompt=prompt, params=_greedy(8), lora_name="support"))
    assert again[2].num_cached_tokens > 0 and again[0] == with_a[0]  # its own blocks are
    assert base[2].num_cached_tokens == 0


def test_an_unknown_adapter_is_refused_at_intake_naming_those_served(lora_engine):
    with pytest.raises(InvalidRequestError, match=r"'nope' is not loaded \(adapters served: 'support', 'legal'\)"):
        lora_engine.submit(Request(prompt="hi", params=_greedy(4), lora_name="nope"))
    assert lora_engine.is_alive()


def _save(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize("config, tensors, match", [
    ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 960),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(576, 4)},
     r"q_proj has lora_A \(4, 960\).*needs \[r, 576\]"),
    ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 49152)},
     "adapts a module this server does not"),
    ({"use_dora": True}, {}, "use_dora=True is not supported"),
    ({}, {"base_model.model.model.layers.40.mlp.down_proj.lora_A.weight": torch.zeros(4, 1536),
          "base_model.model.model.layers.40.mlp.down_proj.lora_B.weight": torch.zeros(576, 4)},
     "the base model has 30 layers"),
])
def test_an_adapter_this_model_cannot_use_is_refused_naming_it(tmp_path, ours, config, tensors, match):
    folder = _save(tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=match) as e:
        load_adapter("bad-one", folder, ours.cfg)
    assert "LoRA adapter 'bad-one'" in str(e.value)


@torch.inference_mode()
def test_an_adapter_whose_values_are_bfloat16_is_held_so_with_the_same_bits(ours, adapters, tmp_path):
    """lora_dtype auto holds an adapter whose every value is a bfloat16 in bfloat16 (half the bytes a
    step reads): the C kernels widen them exactly, so its logits are those of the float32 copy."""
    import shutil

    from safetensors.torch import load_file, save_file

    folders, _ = adapters
    folder = tmp_path / "rounded"
    folder.mkdir()
    shutil.copy(folders["support"] / "adapter_config.json", folder)
    tensors = load_file(str(folders["support"] / "adapter_model.safetensors"))
    save_file({k: v.to(torch.bfloat16).float() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    held = load_adapter("rounded", folder, ours.cfg)
    wide = load_adapter("rounded", folder, ours.cfg, "float32")
    assert {p.a.dtype for layer in held.layers for ps in layer for p in ps} == {torch.bfloat16}
    assert held.nbytes * 2 == wide.nbytes
    assert load_adapter("support", folders["support"], ours.cfg).layers[0][0][0].a.dtype == torch.float32
    bank = LoRABank(ours.cfg, 4, 2)
    bank.place(0, held)
    bank.place(1, wide)
    bank.bind(0, 0)
    bank.bind(1, 1)
    ours.lora = bank
    try:
        kv = KVCache(30, 4, 3, 128, 64, torch.float32)
        ids = list(range(300, 340))
        assert torch.equal(_logits(ours, kv, ids, 0), _logits(ours, kv, ids, 1))
    finally:
        ours.lora = None


@torch.inference_mode()
def test_tensorrt_llm_lora_tasks_weights_once_then_the_id(lora_engine, adapters):
    """TensorRT-LLM's interface: the first request sends `lora_task_id` with `lora_weights` and
    `lora_config` (hf_lora_convert.py's layout, the scale folded into B); later ones the id alone.
    Greedy text is peft's; an id never sent is TensorRT-LLM's error; weights that do not fit the
    model are refused naming the row."""
    from ..lora_helpers import trtllm_arrays

    folders, pm = adapters
    engine = lora_engine
    ids = engine.tokenizer.encode(PROMPTS[2])
    want = peft_greedy(pm, "legal", ids, 24)
    weights, config = trtllm_arrays(folders["legal"])
    first = run_alone(engine, Request(prompt_ids=ids, params=_greedy(24), lora_task_id=7, lora_weights=weights[0],
                                      lora_config=config[0]))[0]
    assert first == want
    assert run_alone(engine, Request(prompt_ids=ids, params=_greedy(24), lora_task_id=7))[0] == want
    with pytest.raises(InvalidRequestError, match="LoRA task 8 not found in cache. Please send LoRA weights"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_task_id=8))
    bad = config[0].copy()
    bad[3, 2] = 4096  # an adapter size past the row
    with pytest.raises(InvalidRequestError, match="lora_config row 3: adapter size 4096 does not fit"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_task_id=9, lora_weights=weights[0],
                              lora_config=bad))
    bad[3] = [12, 0, 16]  # cross attention: not in this model
    with pytest.raises(InvalidRequestError, match="module id 12 is not one this model has"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_task_id=9, lora_weights=weights[0],
                              lora_config=bad))
    with pytest.raises(InvalidRequestError, match="need a lora_task_id"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_weights=weights[0], lora_config=config[0]))
    assert engine.is_alive()


def test_guided_answers_with_an_adapter_close_valid_within_the_budget_and_speculation_stays_lossless(lora_engine):
    """Guides and budget closing work with an adapter as without: held-out JSONSchemaBench schemas,
    48 tokens (far below what the answers take), every answer valid JSON of its schema, the same with
    speculation on and off."""
    import dataclasses

    from specguide.guided.value_check import make_validator
    from specguide.request import GuidedDecodingParams
    from specguide.training.prompts import load_schemas, schema_message

    from .test_guided_engine import run_many

    engine = lora_engine
    reqs = []
    for i, text in enumerate(load_schemas("heldout", engine.core.compiler)[:4]):
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": schema_message(text)}])
        reqs.append(Request(prompt=prompt, params=SamplingParams(max_tokens=48, temperature=0.0),
                            guided=GuidedDecodingParams("json_schema", text), lora_name=("support", "legal")[i % 2]))
    off = run_many(engine, [dataclasses.replace(r, num_draft_tokens=0) for r in reqs])
    on = run_many(engine, reqs)
    closed = 0
    for (toks, text, final), (toks_on, _, final_on), r in zip(off, on, reqs):
        assert final.finish_reason == "stop", (final.error, text)
        assert make_validator(json.loads(r.guided.guide)).is_valid(json.loads(text)), text
        assert (toks_on, final_on.finish_reason) == (toks, final.finish_reason)
        closed += any(n.startswith("closed by the budget") for n in final.guide_notes)
    assert closed >= 1


@torch.inference_mode()
def test_int8_adapters_stay_close_to_float32_and_keep_each_rows_bits_in_a_batch(ours, adapters):
    """lora_dtype int8 (a scale per rank row, a quarter of the bytes): logits close to the float32
    adapter's, and a row's bits the same alone and beside rows with other adapters."""
    folders, _ = adapters
    wide = load_adapter("legal", folders["legal"], ours.cfg, "float32")
    narrow = load_adapter("legal", folders["legal"], ours.cfg, "int8")
    assert {p.a.dtype for layer in narrow.layers for ps in layer for p in ps} == {torch.int8}
    assert narrow.nbytes < wide.nbytes / 3.5
    bank = LoRABank(ours.cfg, 4, 3)
    for i, adapter in enumerate((wide, narrow, load_adapter("support", folders["support"], ours.cfg, "int8"))):
        bank.place(i, adapter)
        bank.bind(i, i)
    ours.lora = bank
    try:
        kv = KVCache(30, 4, 3, 128, 64, torch.float32)
        ids = list(range(500, 530))
        alone = [_logits(ours, kv, ids, row) for row in range(3)]
        assert (alone[0] - alone[1]).abs().max().item() < 0.1  # int8 rounding of a mild adapter
        assert not torch.equal(alone[0], alone[1])
        ctx = ours.make_context(torch.tensor([0, 1, 2]), torch.arange(30)[None].repeat(3, 1), [0, 1, 2], 30)
        together = ours.logits(ours(torch.tensor([ids] * 3), ctx, kv))
        assert all(torch.equal(together[r], alone[r]) for r in range(3))
        fused = ours.fused
        ours.fused = None  # the torch path dequantizes the same values
        try:
            assert (_logits(ours, kv, ids, 1) - alone[1]).abs().max().item() < 1e-3
        finally:
            ours.fused = fused
    finally:
        ours.lora = None
