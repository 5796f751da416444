"""Proposer: which drafts each decode step verifies. Owns the drafters (n-gram, grammar-forced,
trained head, hybrid, early exit, draft model), the per-slot draft budget (adaptive K) and the
per-slot acceptance estimate."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import EngineConfig
from ..models.llama import LlamaModel
from ..models.loader import load_model, resolve_model_dir
from ..runner import Pick, Runner
from ..scheduler import Sequence
from .draft_head import DraftHead, default_head_path
from .draft_model import DraftModel
from .head_drafter import HeadDrafter
from .ngram import NgramDrafter

log = logging.getLogger("specguide")
HEAD_UNSURE = 0.3  # hybrid: below this top probability of the head, an n-gram continuation wins
ADAPTIVE_MIN_ODDS = 0.15  # adaptive K: a draft whose estimated acceptance odds fall below is not proposed


class Proposer:
    """Drafts for a batch of decoding sequences, from the configured drafter."""

    def __init__(self, config: EngineConfig, model: LlamaModel, runner: Runner, folder: Path,
                 encode: Callable[[str], list[int]], dtype: torch.dtype, device: torch.device):
        self.config, self.runner, self.guided, self.encode = config, runner, runner.guided, encode
        self.ngram = NgramDrafter(max_ngram=config.ngram_max)
        self.drafter = config.drafter
        self.head: Optional[HeadDrafter] = None
        self.draft_model: Optional[DraftModel] = None
        K = config.num_draft_tokens
        if config.drafter in ("head", "hybrid") and K:
            self.head = self._load_head(model, folder, device)
            if self.head is None:
                self.drafter = "grammar"
            else:
                runner.feature_sink = self.head.record
        if config.drafter == "draft_model" and K:
            dm = load_model(resolve_model_dir(config.draft_model_dir), dtype, str(device), config.weight_dtype)
            if dm.cfg.vocab_size != model.cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dm.cfg.vocab_size}) differs from the "
                                 f"target's ({model.cfg.vocab_size}); it must share the tokenizer")
            self.draft_model = DraftModel(dm, config.max_slots, config.max_seq_len, K, config.prefill_chunk, device)
        self.accept_rate = [1.0] * config.max_slots  # per-slot moving average of draft acceptance

    def _load_head(self, model: LlamaModel, folder: Path, device: torch.device) -> Optional[HeadDrafter]:
        cfg = self.config
        path = Path(cfg.draft_head_path) if cfg.draft_head_path else default_head_path(folder)
        if not path.exists():
            log.warning("drafter %r: no trained draft head at %s; using the 'grammar' drafter. Train it "
                        "once with: python scripts/train_draft_head.py (or `make draft-head`)", cfg.drafter, path)
            return None
        head = DraftHead.load(path, model, cfg.draft_head_weight_dtype)
        log.info("draft head %s (draft vocabulary %d, %s weights)", path, head.draft_vocab_size,
                 head.lm.weight_dtype if hasattr(head.lm, "weight_dtype") else "model dtype")
        return HeadDrafter(head, cfg.max_slots, cfg.max_seq_len, cfg.num_draft_tokens, cfg.prefill_chunk, device)

    # ---- per slot ---------------------------------------------------------------------------
    def reset(self, slot: int) -> None:
        """A new sequence in the slot."""
        self.accept_rate[slot] = 1.0

    def observe(self, slot: int, drafted: int, accepted: int) -> None:
        """One verification's outcome for the slot (adaptive K)."""
        if drafted:
            self.accept_rate[slot] = 0.7 * self.accept_rate[slot] + 0.3 * accepted / drafted

    def budget(self, seq: Sequence) -> int:
        """Drafts worth proposing for this sequence now (0 = plain decoding)."""
        p = seq.params
        if (seq.num_draft_tokens == 0 or p.penalized or p.bad_words_ids
                or len(seq.output_ids) < p.min_tokens):  # per-position bans: no speculation
            return 0
        k = min(seq.num_draft_tokens, p.max_tokens - len(seq.output_ids) - 1,
                self.config.max_seq_len - seq.num_tokens - 1)
        if self.config.adaptive_k and k > 1:  # keep draft i while rate^i (its odds) is worth a row
            rate = self.accept_rate[seq.slot]
            k = min(k, next((i for i in range(1, k + 1) if rate ** (i + 1) < ADAPTIVE_MIN_ODDS), k))
        return max(0, k)

    # ---- drafts -----------------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[list[int]], bool]:
        """(drafts per sequence, whether the drafting already filled the verification masks)."""
        if not any(ks):
            return [[] for _ in seqs], False
        masked = self.config.mask_drafts
        if self.head is not None:
            pick = self._hybrid_pick(seqs, ks) if self.drafter == "hybrid" else None
            return self.runner.draft_greedy(seqs, ks, self._head_step(seqs), masked=masked,
                                            d2t=self.head.d2t, pick=pick), masked
        if self.drafter == "early_exit":
            return self.runner.draft_early_exit(seqs, ks, masked=masked), masked
        if self.draft_model is not None:
            self.draft_model.catch_up(seqs)
            step = self.runner.chained(seqs, self.draft_model.step)
            return self.runner.draft_greedy(seqs, ks, step, masked=masked), masked
        if self.drafter == "grammar":
            return [self.chain(s, k, trusted_only=False) for s, k in zip(seqs, ks)], False
        return [self.ngram_drafts(s, k) for s, k in zip(seqs, ks)], False

    def ngram_drafts(self, seq: Sequence, k: int) -> list[int]:
        """Prompt-lookup drafts over the sequence's prompt and output."""
        return self.ngram.propose(seq.prompt_ids + seq.output_ids, k)

    def commit(self, seqs: list[Sequence], drafts: list[list[int]], accepted: list[int]) -> None:
        """After verification (before the tokens are appended)."""
        if self.draft_model is not None:
            for s, d, a in zip(seqs, drafts, accepted):
                self.draft_model.commit(s, s.num_tokens, len(d), a)

    def _head_step(self, seqs: list[Sequence]) -> Callable[[int, list[int]], torch.Tensor]:
        """draft_greedy's step for the trained head: catch-up + first draft, then chained steps."""
        hd = self.head
        state: dict[str, torch.Tensor] = {}

        def step(i: int, prev: list[int]) -> torch.Tensor:
            state["g"] = hd.first(seqs) if i == 0 else hd.next(seqs, state["g"], prev, i)
            return hd.logits(state["g"])
        return step

    def _hybrid_pick(self, seqs: list[Sequence], ks: list[int]) -> Pick:
        """The hybrid's per-slot, per-position choice: grammar-forced tokens and trusted n-gram
        chains first; else the head's masked argmax, unless the head is unsure (top probability
        under HEAD_UNSURE) and the n-gram lookup continues the drafts so far."""
        chains = [self.chain(s, k, trusted_only=True) for s, k in zip(seqs, ks)]
        drafted: list[list[int]] = [[] for _ in seqs]

        def pick(i: int, tokens: list[int], logits: torch.Tensor) -> list[int]:
            top = None
            for b, s in enumerate(seqs):
                if i < len(chains[b]):
                    tokens[b] = chains[b][i]
                elif ks[b] > i:
                    if top is None:
                        top = logits.softmax(-1).amax(-1).tolist()
                    if top[b] < HEAD_UNSURE:
                        cont = self.ngram.propose(s.prompt_ids + s.output_ids + drafted[b], 1)
                        tokens[b] = cont[0] if cont else tokens[b]
                drafted[b].append(tokens[b])
            return tokens
        return pick

    def chain(self, seq: Sequence, k: int, trusted_only: bool) -> list[int]:
        """Model-free drafts: the grammar-forced tokens (guided slots), then the n-gram
        continuation (hybrid: only when its suffix match is at least ngram_trust tokens)."""
        forced = self.guided.forced_tokens(seq.slot, self.encode, k) if seq.grammar is not None else []
        cont, size = self.ngram.match(seq.prompt_ids + seq.output_ids + forced, k - len(forced))
        if trusted_only and size < self.config.ngram_trust:
            cont = []
        return forced + cont
