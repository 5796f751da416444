"""Proposer: which drafts each decode step verifies. Owns the drafters (n-gram, grammar-forced,
trained head, hybrid, early exit, draft model), the draft budgets (adaptive K, the row cap, the
measured step cost) and the per-slot acceptance estimate."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from ..config import EngineConfig
from ..engine.kv_cache import KVCache, kv_store
from ..models.llama import LlamaModel
from ..models.loader import load_model, resolve_model_dir
from ..engine.scheduler import Sequence, SlotOwner
from .draft_head import DraftHead, default_head_path
from .draft_model import DraftModel
from .early_exit import EarlyExitDrafter
from .head_drafter import HeadDrafter
from .hybrid import HybridPicks
from .ngram import NgramDrafter, SuffixIndex
from .plan import DraftPlan
from .step_cost import StepCosts

log = logging.getLogger("specguide")
SLOT_DECAY = 0.7  # weight of a slot's old acceptance counts per verification
PRIOR_DECAY = 0.9  # weight of the old acceptance prior's counts per verification
PRIOR_RELAX = 0.1  # per plain step, how far a slot's acceptance estimate moves back toward its kind's prior
ADAPTIVE_MIN_ODDS = 0.15  # adaptive K: a draft whose estimated acceptance odds fall below is not proposed
SURE_NGRAM = 4  # cost_aware_k: what follows an earlier occurrence of the last 4 tokens counts as sure drafts


class Proposer(SlotOwner):
    """Drafts for a batch of decoding sequences, from the configured drafter."""

    def __init__(self, config: EngineConfig, model: LlamaModel, kv: KVCache, guided, folder: Path,
                 encode: Callable[[str], list[int]], dtype: torch.dtype, device: torch.device):
        self.config, self.guided, self.encode = config, guided, encode
        self.ngram = NgramDrafter(max_ngram=config.ngram_max)
        self.drafter = config.drafter
        self.head: Optional[HeadDrafter] = None
        self.draft_model: Optional[DraftModel] = None
        K = config.num_draft_tokens
        self.head_path: Optional[Path] = None  # the trained head's file ("head" / "hybrid")
        self._model, self._device, self._kv = model, device, kv
        self._bad_head: Optional[float] = None  # mtime of a head file that failed to load
        if config.drafter in ("head", "hybrid") and K:
            self.head_path = Path(config.draft_head_path) if config.draft_head_path else default_head_path(folder)
            self.head = self._load_head()
            if self.head is None:
                self.drafter = "grammar"
        # per slot: the head has the target's features of the whole sequence (False for sequences
        # that began before a head was attached while serving: they keep model-free drafts)
        self.head_ready = [self.head is not None] * config.max_slots
        self.early_exit = EarlyExitDrafter(model, kv, config.draft_layers) if config.drafter == "early_exit" else None
        if config.drafter == "draft_model" and K:
            dm = load_model(resolve_model_dir(config.draft_model_dir), dtype, str(device), config.weight_dtype,
                            getattr(model, "integer_dot", False), config.packed_weights_cache)
            if dm.cfg.vocab_size != model.cfg.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dm.cfg.vocab_size}) differs from the "
                                 f"target's ({model.cfg.vocab_size}); it must share the tokenizer")
            self.draft_model = DraftModel(dm, config.max_slots, config.max_seq_len, K, config.prefill_chunk, device,
                                          kv_store(config, dm), kv.table, kv.num_blocks)
        # per slot: p, the chance that a draft is accepted when the drafts before it were (what adaptive
        # K and the step cost's geometric sum take), as moving counts: accepted / judged drafts
        self.accept_rate = [1.0] * config.max_slots
        self.judged = [1.0] * config.max_slots  # the moving count of judged drafts behind accept_rate
        # the recent acceptance of each kind (guided or not): with cost_aware_k a new sequence starts
        # from it and a slot that does not verify drifts back to it. Chat drafts are rarely accepted, so a
        # chat request does not verify (nor have the head catch its prompt up) at its first steps;
        # a repetitive one still drafts at once: its recurring n-grams count as sure (`sure_ngram`)
        self.accept_prior = {False: 1.0, True: 1.0}  # unguided, guided
        self.prior_judged = {False: 1.0, True: 1.0}
        self.suffixes = [SuffixIndex(SURE_NGRAM) for _ in range(config.max_slots)]  # sure_ngram's, per slot
        self.slot_guided = [False] * config.max_slots
        self.step_forced: dict[int, int] = {}  # slot -> sure drafts (forced, recurring n-gram) in this step's plan
        self.step_costs = (StepCosts() if config.cost_aware_k and K and device.type == "cpu"
                           else None)  # host clock: CPU only

    def _load_head(self) -> Optional[HeadDrafter]:
        cfg, path = self.config, self.head_path
        if path is None or not path.exists():
            how = "make draft-head MODEL_REPOSITORY=<this model repository>" if cfg.model_dir else "make draft-head"
            log.warning("drafter %r: no trained draft head at %s; drafting grammar-forced tokens + n-gram "
                        "until one is written there (the server trains it in the background; or: %s)",
                        cfg.drafter, path, how)
            return None
        head = DraftHead.load(path, self._model, cfg.draft_head_weight_dtype)
        log.info("draft head %s (draft vocabulary %d, %s weights)", path, head.draft_vocab_size,
                 head.lm.weight_dtype if hasattr(head.lm, "weight_dtype") else "model dtype")
        return HeadDrafter(head, cfg.max_slots, cfg.max_seq_len, cfg.num_draft_tokens, cfg.prefill_chunk,
                           self._device, self._kv.table, self._kv.num_blocks)

    @property
    def awaits_head(self) -> bool:
        """A head is configured but not loaded yet (`attach_head` looks for its file)."""
        return self.head is None and self.head_path is not None

    def attach_head(self) -> bool:
        """Between steps: load the head if its file has appeared (saves are atomic renames). It
        drafts for sequences admitted from now on; the ones already running keep model-free
        drafts until they end (the head lacks their earlier features). True when attached."""
        if not self.awaits_head or not self.head_path.exists():
            return False
        mtime = self.head_path.stat().st_mtime
        if mtime == self._bad_head:
            return False
        try:
            self.head = self._load_head()
        except Exception:
            log.exception("draft head %s could not be loaded; still drafting without it", self.head_path)
            self._bad_head = mtime
            return False
        self.drafter = self.config.drafter
        self.head_ready = [False] * self.config.max_slots
        if self.step_costs is not None:  # model-drafted steps cost what host-drafted ones did not
            self.step_costs = StepCosts()
        return True

    # ---- per slot ---------------------------------------------------------------------------
    @property
    def feature_sink(self):
        """Called by the target forwards with (slots, positions, hidden): the head's features."""
        return self.head.record if self.head is not None else None

    def admit(self, slot: int, seq: Sequence) -> None:
        """A new sequence in the slot."""
        self.slot_guided[slot] = seq.guide.params is not None
        # cost_aware_k: from its kind's recent acceptance; else 1.0 (a request's drafts never depend
        # on the requests before it)
        self.accept_rate[slot] = self.accept_prior[self.slot_guided[slot]] if self.step_costs is not None else 1.0
        self.judged[slot] = 1.0
        self.suffixes[slot] = SuffixIndex(SURE_NGRAM)
        self.head_ready[slot] = self.head is not None  # (blocks computed before it came are never shared)
        for d in (self.head, self.draft_model):
            if d is not None:
                d.admit(slot, seq)

    def drop_rows(self, slot: int) -> None:
        """The slot's KV blocks are gone (preempted): the drafters' rows there too."""
        for d in (self.head, self.draft_model):
            if d is not None:
                d.drop_rows(slot)

    def observe(self, slot: int, drafted: int, accepted: int, forced: int = 0) -> None:
        """One verification's outcome for the slot (adaptive K); its first `forced` drafts were sure
        ones (`forced`: not what the estimate is of). A verification judges each accepted draft and
        the first rejected one (those after it are never judged): accepted / judged estimates p, where
        accepted / drafted would not (p = 0.7 and 3 drafts: 0.51)."""
        free = drafted - forced
        if free > 0:
            hits = max(0, accepted - forced)
            judged = hits + (hits < free)
            self.accept_rate[slot], self.judged[slot] = _moving_ratio(
                self.accept_rate[slot], self.judged[slot], hits, judged, SLOT_DECAY)
            kind = self.slot_guided[slot]
            self.accept_prior[kind], self.prior_judged[kind] = _moving_ratio(
                self.accept_prior[kind], self.prior_judged[kind], hits, judged, PRIOR_DECAY)

    def budget(self, seq: Sequence, forced: int = 0) -> int:
        """Drafts worth proposing for this sequence now (0 = plain decoding); at least the `forced`
        tokens the grammar forces next, which adaptive K does not shorten."""
        p = seq.params
        if (seq.num_draft_tokens == 0 or p.penalized or p.bad_words_ids
                or len(seq.output_ids) < p.min_tokens):  # per-position bans: no speculation
            return 0
        k = min(seq.num_draft_tokens, p.max_tokens - len(seq.output_ids) - 1,
                self.config.max_seq_len - seq.num_tokens - 1)
        if self.config.adaptive_k and k > 1:  # keep draft i while rate^i (its odds) is worth a row
            rate = self.accept_rate[seq.slot]
            k = min(k, max(forced, next((i for i in range(1, k + 1) if rate ** (i + 1) < ADAPTIVE_MIN_ODDS), k)))
        return max(0, k)

    def forced(self, seq: Sequence) -> int:
        """How many of the slot's next drafts are all but sure: on a guided slot the tokens its grammar
        forces (jump-forward; drafted first by the grammar and hybrid drafters and by any masked
        drafter), on an unguided one a recurring n-gram's continuation (`sure_ngram`; drafted first
        by the n-gram, grammar and hybrid drafters). They count in full in the step's expected
        tokens and in its K. 0 without cost_aware_k (CPU): on a GPU this host work (and its wait
        for the grammar stream) would come before every step."""
        if self.step_costs is None or not seq.num_draft_tokens:
            return 0
        if self.guided.is_guided(seq.slot):
            if not (self.drafter in ("grammar", "hybrid") or self.config.mask_drafts):
                return 0
            return len(self.guided.forced_tokens(seq.slot, self.encode, seq.num_draft_tokens))
        return self.sure_ngram(seq, seq.num_draft_tokens) if self.drafter in ("ngram", "grammar", "hybrid") else 0

    def sure_ngram(self, seq: Sequence, k: int) -> int:
        """Up to k: the tokens that followed the latest earlier occurrence of the sequence's last
        SURE_NGRAM tokens (what the n-gram drafter proposes then), 0 when they have not occurred."""
        return self.suffixes[seq.slot].continuation(seq, k)

    # ---- drafts -----------------------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> DraftPlan:
        """Budgets for this step (adaptive K, at most spec_max_rows verification rows, and only
        when the measured step cost is repaid), then the drafts or the in-step drafter."""
        forced = [self.forced(s) for s in seqs]
        ks = [self.budget(s, f) for s, f in zip(seqs, forced)]
        if self.config.spec_max_rows:  # at most spec_max_rows rows in the verification forward
            cap = max(0, self.config.spec_max_rows // len(seqs) - 1)
            ks = [min(k, cap) for k in ks]
        forced = [min(f, k) for f, k in zip(forced, ks)]
        self.step_forced = {s.slot: f for s, f in zip(seqs, forced)}
        costs = self.step_costs
        if costs is not None and not costs.speculate(ks, [self.accept_rate[s.slot] for s in seqs], forced):
            ks = [0] * len(seqs)  # drafts would cost more than they return now
            for s in seqs:  # unobserved, a slot's estimate drifts back to its kind's (else one poor
                # verification kept it low, and the slot plain, until the next probe)
                prior = self.accept_prior[self.slot_guided[s.slot]]
                self.accept_rate[s.slot] += PRIOR_RELAX * (prior - self.accept_rate[s.slot])
        if not any(ks):
            return DraftPlan(ks, drafts=[[] for _ in seqs])
        masked = self.config.mask_drafts
        if self.head is not None and all(self.head_ready[s.slot] for s in seqs):
            picker = None
            if self.drafter == "hybrid":
                forced = lambda slot, k: self.guided.inner.forced_tokens(slot, self.encode, k)  # noqa: E731
                picker = HybridPicks([s.prompt_ids + s.output_ids for s in seqs], forced, self.ngram,
                                     self.config.ngram_trust, ks)
            return DraftPlan(ks, drafter=self.head, picker=picker, masked=masked)
        if self.early_exit is not None or self.draft_model is not None:
            return DraftPlan(ks, drafter=self.early_exit or self.draft_model, masked=masked)
        if self.drafter == "grammar" or self.head is not None:  # no head yet, or one not ready for every row
            return DraftPlan(ks, drafts=[self.chain(s, k) for s, k in zip(seqs, ks)])
        return DraftPlan(ks, drafts=[self.ngram_drafts(s, k) for s, k in zip(seqs, ks)])

    def record(self, seqs: list[Sequence], results: list[tuple[list[int], int, int]],
               seconds: Optional[float]) -> None:
        """A step's outcome: acceptance per slot (adaptive K) and its cost (None: not a measure of it)."""
        for s, (_, drafted, accepted) in zip(seqs, results):
            self.observe(s.slot, drafted, accepted, self.step_forced.get(s.slot, 0))
        # a drafter's catch-up (a new prompt's rows, or those of the plain steps since the sequence
        # last drafted) is paid once per token whenever drafting resumes, not by this step: left out,
        # or a step after plain ones looked up to twice its cost and drafting stopped where it pays
        caught_up = sum(d.take_catchup_s() for d in (self.head, self.draft_model) if d is not None)
        if self.step_costs is not None and seconds is not None:
            self.step_costs.record(len(seqs), max(d for _, d, _ in results), max(0.0, seconds - caught_up))

    def ngram_drafts(self, seq: Sequence, k: int) -> list[int]:
        """Prompt-lookup drafts over the sequence's prompt and output."""
        return self.ngram.propose(seq.prompt_ids + seq.output_ids, k)

    def chain(self, seq: Sequence, k: int) -> list[int]:
        """Model-free drafts: the grammar-forced tokens (guided slots), then the n-gram continuation."""
        forced = self.guided.forced_tokens(seq.slot, self.encode, k) if self.guided.is_guided(seq.slot) else []
        return self.ngram.chain(seq.prompt_ids + seq.output_ids, forced, k)[0]


def _moving_ratio(rate: float, judged: float, hits: int, new_judged: int, decay: float) -> tuple[float, float]:
    """(rate, judged) after one more outcome: accepted and judged drafts each a moving sum with `decay`,
    rate their ratio (the ratio of sums, not a mean of per-verification ratios: that is biased low)."""
    w = decay * judged + (1 - decay) * new_judged
    return (decay * rate * judged + (1 - decay) * hits) / w, w
