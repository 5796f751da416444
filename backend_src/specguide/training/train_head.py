"""Self-distillation of the EAGLE-style draft head on the target's own greedy outputs.

1. `generate_corpus`: the target answers training prompts (JSON-schema prompts under their
   grammar, chat prompts unguided), greedy, through the engine itself.
2. `compute_features`: one teacher-forced target pass per sequence gives f_p for every position.
3. `train`: the head learns to predict x_{p+2} from (f_p, x_{p+1}) and, unrolled ("training-time
   test"), from its own estimates (g_{p-1}, x_{p+1}) for draft depths 2..D, with the attention
   pattern it sees at inference (real keys up to p-j+1, then its own speculative keys).
Deterministic from a seed (fixed thread count, fixed data order).
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..config import EngineConfig
from ..engine import Engine
from ..kv_cache import KVCache
from ..models.llama import LlamaModel, apply_rope, rms_norm
from ..progress import Progress
from ..request import GuidedDecodingParams, Request, SamplingParams
from ..speculative.draft_head import DraftHead
from .prompts import CHAT_TRAIN, SCHEMA_TEMPLATES, load_schemas, load_subschemas, schema_message

log = logging.getLogger("specguide.train")


@dataclass
class TrainConfig:
    """Knobs of one training run (the defaults take ~22 minutes on a 2-core CPU)."""

    seed: int = 0
    num_schemas: int = 80  # JSON schemas (train split)
    schema_variants: int = 4  # prompt phrasings per schema (prompts.SCHEMA_TEMPLATES)
    num_subschemas: int = 0  # + nested object schemas of the train split (prompts.load_subschemas; 265 compile)
    num_chat: int = 48  # chat prompts
    max_tokens_json: int = 160
    max_tokens_chat: int = 192
    draft_vocab: int = 8192  # most frequent output tokens (+ EOS); 0 = the whole vocabulary
    depth: int = 3  # unrolled draft steps trained (training-time test)
    depth_decay: float = 0.8  # loss weight of depth j: decay**(j-1)
    feature_weight: float = 0.5  # smooth-L1 of g_p against the target's f_{p+1} (EAGLE-1's regression)
    hard_weight: float = 0.2  # CE on the emitted token, next to the soft target distribution
    epochs: int = 8
    lr: float = 1e-3
    val_fraction: float = 0.1
    threads: int = 0  # 0 = torch default


@dataclass
class Sample:
    tokens: list[int]  # prompt + output
    prompt_len: int
    feats: Optional[torch.Tensor] = None  # [L, H] f_p of every position


@dataclass
class TrainReport:
    samples: int = 0
    output_tokens: int = 0
    vocab_coverage: float = 0.0  # fraction of output tokens inside the draft vocabulary
    seconds: dict[str, float] = field(default_factory=dict)
    val_accuracy: list[float] = field(default_factory=list)  # top-1 agreement per depth (held-out samples)
    val_accept_per_step: float = 0.0  # 1 + expected accepted drafts at K=depth, from chained accuracies


def generate_corpus(engine: Engine, cfg: TrainConfig, schemas: Optional[list[str]] = None) -> list[Sample]:
    """The target's greedy answers to the training prompts (JSON prompts under their schema);
    `schemas` replaces the train split's schema texts."""
    tok = engine.tokenizer
    texts = (schemas if schemas is not None else load_schemas("train", engine.compiler))[: cfg.num_schemas]
    subs = load_subschemas(engine.compiler)[: cfg.num_subschemas] if cfg.num_subschemas else []
    n_phrasings = len(SCHEMA_TEMPLATES)
    work = [(schema_message(s, v), GuidedDecodingParams("json_schema", s), cfg.max_tokens_json)
            for v in range(cfg.schema_variants) for s in texts]
    work += [(schema_message(s, i % n_phrasings), GuidedDecodingParams("json_schema", s), cfg.max_tokens_json)
             for i, s in enumerate(subs)]
    work += [(c, None, cfg.max_tokens_chat) for c in CHAT_TRAIN[: cfg.num_chat]]
    reqs = [Request(prompt=tok.apply_chat_template([{"role": "user", "content": m}]), guided=g,
                    params=SamplingParams(max_tokens=n, temperature=0.0)) for m, g, n in work]
    out: list[Optional[Sample]] = [None] * len(reqs)
    progress = Progress("generate (the target answers the training prompts)", len(reqs), "answers")
    done = threading.Semaphore(0)
    window = threading.Semaphore(2 * engine.config.max_slots)  # bounded: the queue has a limit
    for i, r in enumerate(reqs):
        window.acquire()
        ids = tok.encode(r.prompt)
        toks: list[int] = []

        def cb(o, i=i, ids=ids, toks=toks):
            toks += o.token_ids
            if o.finished:
                out[i] = Sample(ids + toks, len(ids)) if o.finish_reason in ("stop", "length") else None
                progress.update()
                done.release()
                window.release()
        engine.submit(r, cb)
    for _ in reqs:
        done.acquire()
    return [s for s in out if s is not None and len(s.tokens) - s.prompt_len >= 2]


@torch.inference_mode()
def compute_features(model: LlamaModel, samples: list[Sample], chunk: int = 256) -> None:
    """f_p for every position of every sample (one slot, chunked like prefill)."""
    cfg = model.cfg
    L = max(len(s.tokens) for s in samples)
    kv = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, L, cfg.head_dim, model.embed.weight.dtype)
    slots = torch.zeros(1, dtype=torch.int64)
    progress = Progress("features (the target's hidden states)", len(samples), "samples")
    for s in samples:
        parts = []
        for a in range(0, len(s.tokens), chunk):
            b = min(len(s.tokens), a + chunk)
            pos = torch.arange(a, b)[None, :]
            ctx = model.make_context(slots, pos, [0], b)
            parts.append(model(torch.tensor([s.tokens[a:b]]), ctx, kv)[0].float())
        s.feats = torch.cat(parts)
        progress.update()


def build_draft_vocab(samples: list[Sample], size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """d2t: the `size` most frequent output tokens (ties by id) plus `always`, sorted."""
    if size <= 0 or size >= vocab:
        return torch.arange(vocab)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(torch.tensor(s.tokens[s.prompt_len:]), minlength=vocab)
    order = torch.argsort(-counts, stable=True).tolist()  # most frequent first, ties by id
    keep = set(always)
    for t in order:
        if len(keep) >= size:
            break
        keep.add(t)
    return torch.tensor(sorted(keep), dtype=torch.int64)


class Trainer:
    """Training-time-test forward of a DraftHead (plain autograd ops, no KV cache)."""

    def __init__(self, head: DraftHead, target: LlamaModel, cfg: TrainConfig):
        self.head, self.target, self.cfg = head, target, cfg
        V = target.cfg.vocab_size
        self.t2d = torch.full((V,), -100, dtype=torch.int64)
        self.t2d[head.d2t] = torch.arange(head.draft_vocab_size)
        self.lm_weight = target.head_weight[head.d2t].detach().float()  # [Vd, H] frozen

    def _attn_inputs(self, x: torch.Tensor, pos: torch.Tensor):
        c = self.head.cfg
        nh, kvh = c.num_heads, c.num_kv_heads
        qkv = self.head.layer.qkv_proj(x[None])  # [1, P, nh+2kvh, hd]
        cos, sin = self.target.rope_tables(int(pos[-1]) + 1)
        qk = apply_rope(qkv[:, :, : nh + kvh], cos[pos][None, :, None], sin[pos][None, :, None])
        q = qk[0, :, :nh].transpose(0, 1)  # [nh, P, hd]
        k = qk[0, :, nh:].transpose(0, 1).repeat_interleave(nh // kvh, 0)  # [nh, P, hd]
        v = qkv[0, :, nh + kvh:].transpose(0, 1).repeat_interleave(nh // kvh, 0)
        return q, k, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = self.head.layer.out_mlp(x, attn.transpose(0, 1).reshape(x.shape[0], -1))
        return rms_norm(x, self.head.norm, self.head.cfg.rms_norm_eps)

    def unroll(self, s: Sample) -> list[torch.Tensor]:
        """g of depth 1..D at positions p = 0..L-2 ([P, H] each); depth j reads (g^{j-1}_{p-1}, x_{p+1})."""
        head, c = self.head, self.head.cfg
        toks = torch.tensor(s.tokens)
        P = len(s.tokens) - 1
        pos = torch.arange(P)
        e = rms_norm(self.target.embed(toks[1:]).float(), head.embed_norm, c.rms_norm_eps)  # [P, H]
        scale = 1.0 / math.sqrt(c.head_dim)
        keys, vals, outs = [], [], []
        feats = s.feats[:P]
        for j in range(1, self.cfg.depth + 1):
            if j > 1:  # the previous depth's estimate of f_p, from position p-1
                feats = torch.cat([outs[-1][:1], outs[-1][:-1]])
            x = head.fc(torch.cat([feats, e], dim=-1))
            q, k, v = self._attn_inputs(x, pos)
            keys.append(k)
            vals.append(v)
            # real (depth-1) keys at positions <= p-j+1, then depth-d keys at p-(j-d), d = 2..j
            real = (q @ keys[0].transpose(1, 2)) * scale  # [nh, P, P]
            allowed = pos[None, :] <= pos[:, None] - (j - 1)
            real = real.masked_fill(~allowed, float("-inf"))
            diag = []
            for d in range(2, j + 1):
                shift = j - d
                kd = torch.roll(keys[d - 1], shift, dims=1)  # kd[:, p] = keys_d[:, p - shift]
                diag.append((q * kd).sum(-1, keepdim=True) * scale)  # [nh, P, 1]
            scores = torch.cat([real] + diag, dim=-1).softmax(-1)
            attn = scores[..., :P] @ vals[0]
            for i, d in enumerate(range(2, j + 1)):
                vd = torch.roll(vals[d - 1], j - d, dims=1)
                attn = attn + scores[..., P + i: P + i + 1] * vd
            outs.append(self._finish(x, attn))
        return outs

    def losses(self, s: Sample) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Weighted CE over output positions (label x_{p+2}) summed over depths; (correct, total) per depth."""
        outs = self.unroll(s)
        L = len(s.tokens)
        lo = max(s.prompt_len - 2, self.cfg.depth - 1)
        p = torch.arange(lo, L - 2)  # g_p predicts x_{p+2}, an output token
        labels = self.t2d[torch.tensor(s.tokens)[p + 2]]
        if not bool((labels >= 0).any()):
            return torch.zeros(()), [(0, 0)] * len(outs)
        total = torch.zeros(())
        stats = []
        feats_next = s.feats[p + 1]  # [n, H]: what g_p estimates
        with torch.no_grad():  # soft labels: the target's own next-token distribution over the draft vocabulary
            teacher = (feats_next @ self.lm_weight.T).softmax(-1)  # [n, Vd]
        for j, g in enumerate(outs):
            logits = g[p] @ self.lm_weight.T  # [n, Vd]
            soft = -(teacher * logits.log_softmax(-1)).sum(-1).mean()
            loss = soft + self.cfg.hard_weight * F.cross_entropy(logits, labels, ignore_index=-100)
            if self.cfg.feature_weight:
                loss = loss + self.cfg.feature_weight * F.smooth_l1_loss(g[p], feats_next)
            total = total + self.cfg.depth_decay ** j * loss
            stats.append((int((logits.argmax(-1) == labels).sum()), len(p)))
        return total, stats


def train_head(target: LlamaModel, samples: list[Sample], cfg: TrainConfig, report: TrainReport,
               always: list[int]) -> DraftHead:
    """Train a fresh head on `samples` (features computed); held-out accuracy goes to `report`."""
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    n_val = max(1, int(len(samples) * cfg.val_fraction)) if len(samples) > 4 else 0
    val, tr = [samples[i] for i in order[:n_val]], [samples[i] for i in order[n_val:]]
    d2t = build_draft_vocab(tr, cfg.draft_vocab, target.cfg.vocab_size, always)
    outs = sum(len(s.tokens) - s.prompt_len for s in tr)
    inside = set(d2t.tolist())
    report.vocab_coverage = sum(t in inside for s in tr for t in s.tokens[s.prompt_len:]) / max(outs, 1)
    head = DraftHead(target.cfg, d2t).float()
    with torch.no_grad():  # fc starts as "f + embedding/2"; the layer is freshly initialized
        H = target.cfg.hidden_size
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)
        head.fc.weight[:, H:] = torch.eye(H) * 0.5
    trainer = Trainer(head, target, cfg)
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps = cfg.epochs * len(tr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    progress = Progress(f"train ({cfg.epochs} epochs)", steps, "steps")
    for epoch in range(cfg.epochs):
        rng.shuffle(tr)
        t0, tot, right, seen = time.perf_counter(), 0.0, 0, 0
        for s in tr:
            progress.update()
            loss, stats = trainer.losses(s)
            if not stats[0][1] or not torch.isfinite(loss):
                continue  # no output position inside the draft vocabulary
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            tot += float(loss.detach())
            right, seen = right + stats[0][0], seen + stats[0][1]
        val_acc = evaluate(trainer, val) if val else []
        log.info("epoch %d: loss %.3f, train top-1 %.3f, held-out top-1 by depth %s (%.0f s)", epoch + 1,
                 tot / max(1, len(tr)), right / max(seen, 1), [round(a, 3) for a in val_acc],
                 time.perf_counter() - t0)
        if not val or not report.val_accuracy or val_acc[0] > report.val_accuracy[0]:
            report.val_accuracy = val_acc  # keep the best epoch on held-out samples (early stopping)
            best = {k: v.detach().clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best)
    acc, prod = 1.0, 1.0
    for a in report.val_accuracy:  # depth j is trained as if depths < j were right
        prod *= a
        acc += prod
    report.val_accept_per_step = acc
    return head.eval().requires_grad_(False)


@torch.no_grad()
def evaluate(trainer: Trainer, samples: list[Sample]) -> list[float]:
    """Top-1 agreement with the emitted token per depth over the output positions of `samples`."""
    sums = [[0, 0] for _ in range(trainer.cfg.depth)]
    for s in samples:
        for j, (c, n) in enumerate(trainer.losses(s)[1]):
            sums[j][0] += c
            sums[j][1] += n
    return [c / max(n, 1) for c, n in sums]


def run(cfg: TrainConfig, engine: Optional[Engine] = None, schemas: Optional[list[str]] = None
        ) -> tuple[DraftHead, TrainReport, Engine]:
    """The whole pipeline: corpus, features, training. Returns (head, report, engine); the
    caller saves the head and shuts the engine down (a new one is made when none is given)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    report = TrainReport()
    t0 = time.perf_counter()
    engine = engine or Engine(EngineConfig(max_slots=8, max_seq_len=1024, drafter="grammar"))
    samples = generate_corpus(engine, cfg, schemas)
    report.samples = len(samples)
    report.output_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    report.seconds["generate"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    compute_features(engine.model, samples)
    report.seconds["features"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    head = train_head(engine.model, samples, cfg, report, sorted(engine.eos_token_ids))
    report.seconds["train"] = time.perf_counter() - t2
    return head, report, engine
