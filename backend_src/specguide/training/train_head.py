"""Self-distillation of the EAGLE-style draft head on the target's own greedy outputs.

1. `generate_corpus`: the target answers training prompts (JSON-schema prompts under their
   grammar, chat prompts unguided), greedy, through the engine itself.
   The engine's feature sink keeps the target's f_p of every position as it goes
   (`FeatureRecorder`): no second, teacher-forced pass.
2. `train`: the head learns to predict x_{p+2} from (f_p, x_{p+1}) and, unrolled ("training-time
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
from ..engine.loop import Engine
from ..models.llama import LlamaModel, apply_rope, rms_norm
from ..util.progress import Progress
from ..request import GuidedDecodingParams, Request, SamplingParams, UndeclaredKeys
from ..engine.scheduler import Sequence, SlotOwner
from ..speculative.draft_head import DraftHead
from .precision import training_autocast
from .prompts import (CHAT_TRAIN, MAX_SCHEMA_CHARS, SCHEMA_TEMPLATES, data_dir, load_schemas, load_subschemas,
                      schema_message)

log = logging.getLogger("specguide.train")


@dataclass
class TrainConfig:
    """Knobs of one training run (the defaults take ~7 minutes on a 2-core CPU with bf16, ~5.7 in fp32)."""

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
    epochs: int = 0  # 0 = AUTO_EPOCHS of the matmul dtype
    lr: float = 1e-3
    val_fraction: float = 0.1
    threads: int = 0  # 0 = torch default
    matmul_dtype: str = "auto"  # auto | float32 | bfloat16: autocast of the training matmuls (precision.py)


# Epochs by matmul dtype (hybrid tokens per step on the held-out schemas: bench/bench_draft_heads.py):
# bf16's 8 epochs take little longer than fp32's 4 and draft better than 4; fp32 stops at 4, since
# 8 would double its training and put `make serve` past 10 minutes on a CPU without bf16 dot products.
AUTO_EPOCHS = {"bfloat16": 8, "float32": 4}


SERVED_FIELDS = ("model_dir", "gguf_file", "device", "dtype", "weight_dtype", "activation_dtype", "num_threads",
                 "guided_backend", "reasoning_markers")  # what the corpus engine takes from the served configuration


def corpus_engine_config(served: Optional[EngineConfig] = None) -> EngineConfig:
    """The engine that answers the training prompts: the target as `served` loads it (its folder,
    device, dtypes, guide backend, reasoning markers; default: the default model, CUDA when
    present), with 16 slots and K up to 2 at a full batch (2 CPU cores: 132 s for the default
    corpus, 157 s with 8 slots; the same tokens either way)."""
    served = served or EngineConfig()
    return EngineConfig(**{k: getattr(served, k) for k in SERVED_FIELDS}, max_slots=16, spec_max_rows=32,
                        max_seq_len=1024, drafter="grammar", cost_aware_k=False)


@dataclass
class Sample:
    tokens: list[int]  # prompt + output
    prompt_len: int
    feats: Optional[torch.Tensor] = None  # [L-1, H] f_p of every position but the last


@dataclass
class TrainReport:
    samples: int = 0
    output_tokens: int = 0
    vocab_coverage: float = 0.0  # fraction of output tokens inside the draft vocabulary
    matmul_dtype: str = ""  # what the training matmuls ran in
    epochs: int = 0  # how many epochs ran (TrainConfig.epochs, or AUTO_EPOCHS of the matmul dtype)
    seconds: dict[str, float] = field(default_factory=dict)
    val_accuracy: list[float] = field(default_factory=list)  # top-1 agreement per depth (held-out samples)
    val_accept_per_step: float = 0.0  # 1 + expected accepted drafts at K=depth, from chained accuracies


class FeatureRecorder(SlotOwner):
    """The engine's feature sink while the corpus is generated: f_p of every position of every
    slot (rows past the accepted tokens are rewritten by the next forward, as in HeadDrafter),
    copied out when a sequence leaves its slot. Saves a second, teacher-forced pass."""

    def __init__(self, max_slots: int, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        self.feats = torch.zeros(max_slots, rows, hidden, dtype=dtype, device=device)  # [slots, rows, H]
        self.seqs: dict[int, Sequence] = {}  # slot -> its sequence
        self.done: dict[int, torch.Tensor] = {}  # seq_id -> [num_tokens, H] fp32 on CPU

    def record(self, slots: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        self.feats[slots[:, None], positions] = hidden  # hidden [B, T, H] at positions [B, T]

    def admit(self, slot: int, seq: Sequence) -> None:
        self.seqs[slot] = seq

    def free(self, slot: int) -> None:
        seq = self.seqs.pop(slot, None)
        if seq is not None:  # NOTE: runs before the final event, so the callback finds it
            self.done[seq.seq_id] = self.feats[slot, : seq.num_tokens].to("cpu", torch.float32, copy=True)


def user_turn(tok, message: str) -> str:
    """`message` as the model's chat template frames a user turn; a model without one (a base model)
    reads the message and a newline."""
    if getattr(tok.hf, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": message}])
    return message + "\n"


def generate_corpus(engine: Engine, cfg: TrainConfig, schemas: Optional[list[str]] = None) -> list[Sample]:
    """The target's greedy answers to the training prompts (JSON prompts under their schema),
    with its features f_p at every position but the last; `schemas` replaces the train split's
    schema texts."""
    tok = engine.tokenizer
    texts = (schemas if schemas is not None else load_schemas("train", engine.core.compiler))[: cfg.num_schemas]
    if cfg.num_schemas and not texts:  # a head trained on chat alone drafts JSON poorly: say so, do not train it
        raise FileNotFoundError(f"no training schemas (compilable, at most {MAX_SCHEMA_CHARS} characters) under "
                                f"{data_dir()}")
    subs = load_subschemas(engine.core.compiler)[: cfg.num_subschemas] if cfg.num_subschemas else []
    n_phrasings = len(SCHEMA_TEMPLATES)

    def guide(schema: str) -> GuidedDecodingParams:  # the recipe's corpus: the model's own continuations,
        # cut at max_tokens_json (not closed by the budget: forced tokens need no head) under JSON
        # Schema's reading of undeclared keys, as the recorded recipe was generated
        return GuidedDecodingParams("json_schema", schema, undeclared_keys=UndeclaredKeys.ALLOW,
                                    complete_within_budget=False)
    work = [(schema_message(s, v), guide(s), cfg.max_tokens_json) for v in range(cfg.schema_variants) for s in texts]
    work += [(schema_message(s, i % n_phrasings), guide(s), cfg.max_tokens_json) for i, s in enumerate(subs)]
    work += [(c, None, cfg.max_tokens_chat) for c in CHAT_TRAIN[: cfg.num_chat]]
    reqs = [Request(prompt=user_turn(tok, m), guided=g,
                    params=SamplingParams(max_tokens=n, temperature=0.0)) for m, g, n in work]
    out: list[Optional[Sample]] = [None] * len(reqs)
    progress = Progress("generate (the target answers the training prompts)", len(reqs), "answers")
    done = threading.Semaphore(0)
    window = threading.Semaphore(2 * engine.config.max_slots)  # bounded: the queue has a limit
    ec, H = engine.config, engine.core.model.cfg.hidden_size
    recorder = FeatureRecorder(ec.max_slots, ec.max_seq_len + ec.num_draft_tokens + 1, H,
                               engine.core.model.dtype, engine.core.device)
    with engine.core.feature_recording(recorder):
        for i, r in enumerate(reqs):
            window.acquire()
            ids = tok.encode(r.prompt)
            toks: list[int] = []

            def cb(o, i=i, ids=ids, toks=toks):
                toks += o.token_ids
                if o.finished:
                    feats = recorder.done.pop(o.seq_id, None)
                    if o.finish_reason in ("stop", "length") and feats is not None:
                        n = len(ids) + len(toks) - 1  # f_p of every position that predicts a token
                        assert feats.shape[0] >= n, (feats.shape, n)
                        out[i] = Sample(ids + toks, len(ids), feats[:n])
                    progress.update()
                    done.release()
                    window.release()
            engine.submit(r, cb)
        for _ in reqs:
            done.acquire()
    return [s for s in out if s is not None and len(s.tokens) - s.prompt_len >= 2]


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
        self.device = target.device
        # matmuls in this dtype (fp32 master weights, fp32 losses); None = fp32
        self.autocast = training_autocast(cfg.matmul_dtype, self.device, target.cfg.hidden_size)
        V = target.cfg.vocab_size
        d2t = head.d2t.to(self.device)
        self.t2d = torch.full((V,), -100, dtype=torch.int64, device=self.device)
        self.t2d[d2t] = torch.arange(head.draft_vocab_size, device=self.device)
        self.lm_weight = target.head_rows(d2t).detach().to(self.autocast or torch.float32)  # [Vd, H] frozen

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

    def first_loss_position(self, s: Sample) -> int:
        """lo: g_p for p >= lo predicts an output token x_{p+2} (and has D-1 positions before it)."""
        return max(s.prompt_len - 2, self.cfg.depth - 1)

    def unroll(self, s: Sample, every_position: bool = False) -> tuple[int, list[torch.Tensor]]:
        """(r, outs): g of depth 1..D at positions p = r..L-2 ([L-1-r, H] each), r = lo - (D-1)
        (0 with `every_position`); depth j reads (g^{j-1}_{p-1}, x_{p+1}). Below r only the
        depth-1 keys/values are computed: no loss reads a query there (depth j's loss reads depth
        d's rows from lo - (j-d) on), so the losses equal those of unrolling every position, at
        ~1.5x less work on these prompt-heavy samples."""
        head, c = self.head, self.head.cfg
        toks = torch.tensor(s.tokens, device=self.device)
        P = len(s.tokens) - 1
        r = 0 if every_position else self.first_loss_position(s) - (self.cfg.depth - 1)
        pos = torch.arange(P, device=self.device)
        qpos = pos[r:]  # the query positions
        e = rms_norm(self.target.embed(toks[1:]).float(), head.embed_norm, c.rms_norm_eps)  # [P, H]
        scale = 1.0 / math.sqrt(c.head_dim)
        keys, vals, outs = [], [], []
        for j in range(1, self.cfg.depth + 1):
            if j == 1:
                x = head.fc(torch.cat([s.feats[:P].to(self.device), e], dim=-1))  # [P, H]: every position is a key
                q, k, v = self._attn_inputs(x, pos)
                q, x = q[:, r:], x[r:]
            else:  # the previous depth's estimate of f_p, from position p-1 (row 0: never read)
                feats = torch.cat([outs[-1][:1], outs[-1][:-1]])
                x = head.fc(torch.cat([feats, e[r:]], dim=-1))  # [Q, H]
                q, k, v = self._attn_inputs(x, qpos)
            keys.append(k)
            vals.append(v)
            # real (depth-1) keys at positions <= p-j+1, then depth-d keys at p-(j-d), d = 2..j
            real = (q @ keys[0].transpose(1, 2)) * scale  # [nh, Q, P]
            allowed = pos[None, :] <= qpos[:, None] - (j - 1)
            real = real.masked_fill(~allowed, float("-inf"))
            diag = []
            for d in range(2, j + 1):
                kd = torch.roll(keys[d - 1], j - d, dims=1)  # kd[:, i] = keys_d[:, i - (j-d)] (query rows)
                diag.append((q * kd).sum(-1, keepdim=True) * scale)  # [nh, Q, 1]
            scores = torch.cat([real] + diag, dim=-1).softmax(-1)
            attn = scores[..., :P] @ vals[0]
            for i, d in enumerate(range(2, j + 1)):
                vd = torch.roll(vals[d - 1], j - d, dims=1)
                attn = attn + scores[..., P + i: P + i + 1] * vd
            outs.append(self._finish(x, attn))
        return r, outs

    def losses(self, s: Sample, every_position: bool = False) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Weighted CE over output positions (label x_{p+2}) summed over depths; (correct, total) per depth."""
        with torch.autocast(self.device.type, self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            return self._losses(s, every_position)

    def _losses(self, s: Sample, every_position: bool) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        r, outs = self.unroll(s, every_position)
        L = len(s.tokens)
        p = torch.arange(self.first_loss_position(s), L - 2)  # g_p predicts x_{p+2}, an output token
        feats_next = s.feats[p + 1].to(self.device)  # [n, H]: what g_p estimates
        p = p.to(self.device)
        labels = self.t2d[torch.tensor(s.tokens, device=self.device)[p + 2]]
        if not bool((labels >= 0).any()):
            return torch.zeros((), device=self.device), [(0, 0)] * len(outs)
        total = torch.zeros((), device=self.device)
        stats = []
        with torch.no_grad():  # soft labels: the target's own next-token distribution over the draft vocabulary
            teacher = (feats_next @ self.lm_weight.T).float().softmax(-1)  # [n, Vd]
        for j, g in enumerate(outs):
            logp = (g[p - r] @ self.lm_weight.T).float().log_softmax(-1)  # [n, Vd]
            soft = -(teacher * logp).sum(-1).mean()
            loss = soft + self.cfg.hard_weight * F.nll_loss(logp, labels, ignore_index=-100)
            if self.cfg.feature_weight:
                loss = loss + self.cfg.feature_weight * F.smooth_l1_loss(g[p - r].float(), feats_next)
            total = total + self.cfg.depth_decay ** j * loss
            stats.append((int((logp.argmax(-1) == labels).sum()), len(p)))
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
    head = head.to(target.device)
    trainer = Trainer(head, target, cfg)
    report.matmul_dtype = "bfloat16" if trainer.autocast is not None else "float32"
    report.epochs = epochs = cfg.epochs or AUTO_EPOCHS[report.matmul_dtype]
    params = [p for n, p in head.named_parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps = epochs * len(tr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    progress = Progress(f"train ({epochs} epochs, {report.matmul_dtype} matmuls)", steps, "steps")
    for epoch in range(epochs):
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
    engine = engine or Engine(corpus_engine_config())
    samples = generate_corpus(engine, cfg, schemas)
    report.samples = len(samples)
    report.output_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    report.seconds["generate"] = time.perf_counter() - t0
    t2 = time.perf_counter()
    head = train_head(engine.core.model, samples, cfg, report, sorted(engine.core.eos_token_ids))
    report.seconds["train"] = time.perf_counter() - t2
    return head, report, engine
