"""The draft head's training pipeline: features kept while the corpus is generated, and the
loss computed only where it is read."""
from __future__ import annotations

import threading

import pytest
import torch

from specguide.engine.kv_cache import KVCache
from specguide.request import Request, SamplingParams
from specguide.speculative.draft_head import DraftHead
from specguide.training import precision, train_head
from specguide.training.train_head import Sample, TrainConfig, Trainer, generate_corpus

from ..guided.helpers import load_guided_samples
from .conftest import run_alone


@torch.inference_mode()
def teacher_forced(model, tokens: list[int], like: KVCache) -> torch.Tensor:
    """f_p of every position of `tokens` in one pass (one slot, one chunk), on a cache like `like`."""
    kv = like.like(1, len(tokens))
    slots = torch.zeros(1, dtype=torch.int64)
    ctx = model.make_context(slots, torch.arange(len(tokens))[None, :], [0], len(tokens))
    return model(torch.tensor([tokens]), ctx, kv)[0].float()


def test_the_corpus_comes_with_the_features_a_teacher_forced_pass_computes(engine, monkeypatch):
    """Every sample's f_p (kept by the engine's feature sink through chunked prefill, and speculative
    steps whose drafts were partly rejected) equals a fresh teacher-forced pass over the finished
    sequence: no prompt shares blocks while features are recorded (a shared prefix would be fed to
    none of them)."""
    schemas = [s.text for s in load_guided_samples() if s.kind == "json_schema" and "unsupported" not in s.name][:3]
    # a slot that already holds the chat template's prefix from before the recording (CI caught it)
    run_alone(engine, Request(prompt=engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi."}]),
                              params=SamplingParams(max_tokens=4, temperature=0.0)))
    # NOTE: requests admitted in one step cannot share each other's blocks (none computed yet), and with
    # their grammars already compiled (CI: earlier tests) all of them are: the first prompt's first chunk
    # runs before the others arrive, so that they would share the chat template's blocks
    shared = []
    admit = train_head.FeatureRecorder.admit
    monkeypatch.setattr(train_head.FeatureRecorder, "admit",
                        lambda self, slot, seq: (admit(self, slot, seq), shared.append(seq.num_reused)))
    recorded = threading.Event()
    record = train_head.FeatureRecorder.record
    monkeypatch.setattr(train_head.FeatureRecorder, "record", lambda self, *a: (record(self, *a), recorded.set()))
    submit = engine.submit

    def staggered(request, callback):
        seq_id = submit(request, callback)
        assert recorded.wait(60), "the first prompt was never prefilled"
        return seq_id
    monkeypatch.setattr(engine, "submit", staggered)
    cfg = TrainConfig(num_schemas=3, schema_variants=2, num_chat=3, max_tokens_json=40, max_tokens_chat=24)
    samples = generate_corpus(engine, cfg, schemas)
    assert len(samples) == 9
    assert len(shared) == 9 and not any(shared), shared
    assert engine.core.runner.core.feature_sink is None or engine.core.head_drafter is not None  # detached again
    for s in samples:
        assert s.feats.shape == (len(s.tokens) - 1, engine.core.model.cfg.hidden_size)
        ref = teacher_forced(engine.core.model, s.tokens, engine.core.runner.kv)[:-1]
        err = (s.feats - ref).abs().max() / ref.abs().max()
        assert err < 1e-4, (err, len(s.tokens), s.prompt_len)


def test_the_loss_reads_no_prompt_query_and_equals_the_full_unroll(engine):
    """Unrolling only from the first position a loss reads (keys/values of the prompt kept)
    gives the same losses, accuracies and gradients as unrolling every position."""
    model = engine.core.model
    H, V = model.cfg.hidden_size, model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    d2t = torch.arange(0, V, 7)
    cfg = TrainConfig(depth=3, matmul_dtype="float32")
    torch.manual_seed(0)
    head = DraftHead(model.cfg, d2t).float()
    trainer = Trainer(head, model, cfg)
    for prompt_len, out_len in [(40, 12), (3, 20), (60, 3)]:
        tokens = (d2t[torch.randint(0, len(d2t), (prompt_len + out_len,), generator=gen)]).tolist()
        s = Sample(tokens, prompt_len, torch.randn(len(tokens) - 1, H, generator=gen))
        r, outs = trainer.unroll(s)
        assert r == max(prompt_len - 2, 2) - 2 and outs[0].shape == (len(tokens) - 1 - r, H)
        grads = []
        for every in (False, True):
            head.zero_grad(set_to_none=True)
            loss, stats = trainer.losses(s, every_position=every)
            loss.backward()
            grads.append((loss.detach(), stats, [p.grad.clone() for p in head.parameters()]))
        (l0, s0, g0), (l1, s1, g1) = grads
        assert s0 == s1 and s0[0][1] > 0
        torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1):  # float sums in another order: equal to the tensor's scale
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


def test_auto_picks_bf16_only_where_a_measured_gemm_is_clearly_faster(monkeypatch):
    cpu = torch.device("cpu")
    assert precision.training_autocast("float32", cpu, 64) is None
    assert precision.training_autocast("bfloat16", cpu, 64) is torch.bfloat16
    with pytest.raises(ValueError, match="float16"):
        precision.training_autocast("float16", cpu, 64)
    for fp32_s, bf16_s, want in [(1.0, 0.2, torch.bfloat16), (1.0, 0.9, None), (1.0, 3.0, None)]:
        monkeypatch.setattr(precision, "gemm_seconds", lambda dtype, hidden: fp32_s if dtype == torch.float32 else bf16_s)
        assert precision.training_autocast("auto", cpu, 64) is want
    assert precision.gemm_seconds(torch.float32, 64) > 0


def test_bf16_autocast_losses_track_fp32_and_keep_fp32_gradients(engine):
    """Autocast changes the matmuls' precision, not the recipe: the losses stay within 2% and the
    master weights and their gradients stay fp32."""
    model = engine.core.model
    H, V = model.cfg.hidden_size, model.cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    d2t = torch.arange(0, V, 5)
    torch.manual_seed(1)
    head = DraftHead(model.cfg, d2t).float()
    tokens = d2t[torch.randint(0, len(d2t), (90,), generator=gen)].tolist()
    s = Sample(tokens, 50, torch.randn(89, H, generator=gen))
    got = []
    for matmul_dtype in ("float32", "bfloat16"):
        head.zero_grad(set_to_none=True)
        trainer = Trainer(head, model, TrainConfig(matmul_dtype=matmul_dtype))
        assert trainer.autocast is (torch.bfloat16 if matmul_dtype == "bfloat16" else None)
        loss, _ = trainer.losses(s)
        loss.backward()
        assert loss.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in head.parameters())
        got.append(float(loss))
    assert abs(got[1] - got[0]) < 0.02 * got[0], got


def test_no_training_schemas_is_an_error_not_a_chat_only_head(engine, monkeypatch, tmp_path):
    """Without the shipped schemas (a data folder that lost them) the corpus refuses to be made:
    a head trained on chat prompts alone would draft JSON poorly, silently."""
    assert train_head.load_schemas("train", engine.core.compiler)  # the shipped data has them
    monkeypatch.setenv("SPECGUIDE_DATA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no training schemas"):
        generate_corpus(engine, TrainConfig(num_schemas=4, num_chat=2))


@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_epochs_0_trains_as_many_as_the_matmul_dtype_affords(engine, matmul_dtype):
    """TrainConfig.epochs 0: 8 epochs with bf16 matmuls, 4 in fp32 (fp32 at 8 would put a fresh
    `make serve` past 10 minutes); an explicit count wins."""
    model = engine.core.model
    gen = torch.Generator().manual_seed(2)
    samples = [Sample(torch.randint(0, 3000, (40,), generator=gen).tolist(), 30,
                      torch.randn(39, model.cfg.hidden_size, generator=gen)) for _ in range(3)]
    for epochs, want in [(0, train_head.AUTO_EPOCHS[matmul_dtype]), (1, 1)]:
        report = train_head.TrainReport()
        cfg = TrainConfig(epochs=epochs, matmul_dtype=matmul_dtype, draft_vocab=512, val_fraction=0.0)
        train_head.train_head(model, samples, cfg, report, sorted(engine.core.eos_token_ids))
        assert (report.epochs, report.matmul_dtype) == (want, matmul_dtype)
