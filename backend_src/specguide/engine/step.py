"""StepCore: the decode / speculative step, written once; run eagerly or captured as a CUDA graph.

A step: [drafting] + one verification forward over [last, d_0..d_{T-2}] (T = 1: plain decode) +
grammar masks + acceptance (drafts equal to the target's own tokens) + the next token. Drafting
(step_layout.Drafting) is NONE, HOST (drafts known before the step: n-gram, grammar chains), MODEL
(T - 1 forwards of a device drafter inside the step - early exit, trained head, draft model - each
masked by its grammar row; the hybrid's pick is a device-side select between the drafter's argmax
and the proposals the grammar callbacks wrote after the previous draft) or UNMASKED (the
mask_drafts=False ablation).

Inputs and outputs live in static buffers indexed by batch row (step_layout.StepInputs /
StepOutputs name their rows); every shape depends only on the
`StepKey`, so cuda/graphs.py captures `body(key)` as it is. Captured keys pad the batch to a
bucket: padding rows read slot 0 and write K/V only at positions >= max_seq_len (dead rows).
Per-token extras (log probs, raw logits, penalties, bans) need host lists: such steps stay eager.

NOTE: nothing in `body` may make the host wait on the device (no .item() / .tolist(), no
data-dependent shapes): a captured host function takes the GIL, and a host thread that holds the
GIL while waiting on the GPU would deadlock it (pytorch 163061 / 163062). The host reads
`out_host` after `finish`, whose waits release the GIL.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..guided.capturable import CapturableGuidedDecoder
from ..guided.grammar_worker import GuidedStep
from ..guided.stepper import GuidedStepper
from .. import kernels
from ..kernels import TILE
from .kv_cache import KVCache
from ..models.llama import AttnContext, LlamaModel, sparse_head
from .sampler import sample
from .scheduler import Sequence
from .slot_params import SlotSampling
from ..speculative import acceptance
from ..speculative.hybrid import HEAD_UNSURE
from ..speculative.plan import DraftPlan, Drafter
from .step_layout import Drafting, StepInputs, StepOutputs
from .step_extras import StepExtras

BAD_TOKEN = -1  # the next token of a row whose logits hold NaN or +inf: the engine fails that request
SPARSE_HEAD_AT_MOST = (3, 4)  # a sparse LM head when its masks leave at most 3/4 of the output tiles


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] bool: the row holds NaN or +inf (-inf is a mask)."""
    bad = kernels.nonfinite_rows(logits)
    if bad is not None:
        return bad
    top = logits.amax(dim=-1)  # NaN propagates
    return top.isnan() | top.isposinf()


@dataclass(frozen=True)
class StepKey:
    batch: int  # rows (a bucket when captured)
    T: int  # positions per row: 1 = plain decode, else verification of T - 1 drafts
    drafting: Drafting
    length: int  # keys attended (captured: a bucket covering every position; eager: longest row)
    greedy: bool  # every row greedy: argmax acceptance
    truncated: bool  # a sampled row uses top-k / top-p / min-p
    guided: bool  # grammar masks and callbacks
    pick: bool = False  # hybrid: device-side select among proposals
    captured: bool = False  # padded static shapes, asynchronous copies (CUDA graphs and their CPU dry run)
    extras: bool = False  # eager-only per-token work (StepExtras)
    biased: bool = False  # a row has a logit_bias


@dataclass
class StepCore:
    """The step over the target model, its KV cache, the slot sampling state and the grammar."""

    model: LlamaModel
    kv: KVCache
    params: SlotSampling
    guided: CapturableGuidedDecoder  # which slots are guided; its stepper runs the step's grammar work
    max_seq_len: int
    feature_sink: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None
    sparse_lm_head: bool = True  # EngineConfig.sparse_lm_head; False where the head is not a C-kernel one
    drafter: Optional[Drafter] = field(default=None, init=False)  # this step's in-step drafter
    extras: Optional[StepExtras] = field(default=None, init=False)  # this eager step's extras
    riders: Optional[Any] = field(default=None, init=False)  # runner.Riders: prompt chunks in this eager step's forward

    def __post_init__(self) -> None:
        S, K = self.kv.max_slots, self.guided.inner.max_draft_tokens
        self.grammar: GuidedStepper = self.guided.stepper  # the step protocol: launches, masks, commit
        dev, pin = self.kv.k.device, self.kv.k.device.type == "cuda"
        self.max_drafts, self.rows_per_slot = K, self.guided.rows_per_slot
        self.inp_host = StepInputs(torch.zeros(StepInputs.ROWS, S, dtype=torch.int64, pin_memory=pin))
        self.inp = StepInputs(torch.zeros(StepInputs.ROWS, S, dtype=torch.int64, device=dev))
        self.drafts_in = torch.zeros(max(K, 1), S, dtype=torch.int64, device=dev)  # [K, B] host drafts
        self.out = StepOutputs(torch.zeros(StepOutputs.rows(K), S, dtype=torch.int64, device=dev))
        self.out_host = StepOutputs(self.grammar.out_host)  # the grammar callbacks read the drafts and tokens here
        self._stage_in = StepInputs(self.inp_host.buf.numpy())  # host views of the pinned staging
        self._stage_out = StepOutputs(self.out_host.buf.numpy())
        self.arange = torch.arange(K + 1, device=dev)
        self.slot_list: Optional[list[int]] = None  # eager: host slots (consecutive slots: a slice of the block table)
        self.sparse_lm_head = self.sparse_lm_head and sparse_head(self.model)
        # [S * (K+1), V] fp32: an eager CPU step's logits (its pages touched as batches use them).
        # NOTE: a new tensor this size each step is one mmap / munmap past glibc's 32 MiB threshold,
        # its pages faulted in anew: 15 ms a step at 64 rows x 4 positions
        self.logits_buf: Optional[torch.Tensor] = None

    # ---- host side -----------------------------------------------------------------------
    def key(self, seqs: list[Sequence], plan: DraftPlan) -> StepKey:
        """The key of an eager step on exact shapes (a captured step buckets batch and length)."""
        greedy, truncated = self.params.kind([s.slot for s in seqs])
        return StepKey(batch=len(seqs), T=plan.width + 1, drafting=plan.drafting,
                       length=max(s.num_tokens for s in seqs), greedy=greedy, truncated=truncated,
                       guided=any(self.guided.is_guided(s.slot) for s in seqs),
                       pick=plan.picker is not None and plan.drafting is Drafting.MODEL,
                       extras=any(self._needs_extras(s) for s in seqs),
                       biased=any(s.slot in self.params.biased for s in seqs))

    def _needs_extras(self, s: Sequence) -> bool:
        p = s.params
        return bool(p.wants_logprobs or p.return_generation_logits or p.penalized or p.bad_words_ids
                    or (len(s.output_ids) < p.min_tokens and not self.guided.is_guided(s.slot)))

    def stage(self, seqs: list[Sequence], plan: DraftPlan, key: StepKey) -> None:
        """Write the step's inputs (pinned staging, then the static buffers) and queue its grammar
        snapshot; padding rows (b >= len(seqs)) get dead positions of slot 0."""
        h, oh = self._stage_in, self._stage_out
        h.buf[:] = 0
        h.pos0[:] = self.max_seq_len
        oh.drafts[:] = 0
        for b, s in enumerate(seqs):
            h.last[b], h.pos0[b], h.slot[b], h.counter[b] = s.last_token, s.num_tokens - 1, s.slot, len(s.output_ids)
            if key.drafting is Drafting.HOST:
                h.num[b] = len(plan.drafts[b])
                oh.drafts[: len(plan.drafts[b]), b] = plan.drafts[b]
            elif key.drafting is not Drafting.NONE:
                h.num[b] = plan.ks[b]
        nb = key.captured
        self.inp.buf.copy_(self.inp_host.buf, non_blocking=nb)
        if key.drafting is Drafting.HOST:
            self.drafts_in[: self.max_drafts].copy_(self.out_host.drafts, non_blocking=nb)
        self.drafter = plan.drafter if key.drafting.in_step else None
        self.slot_list = None if key.captured else [s.slot for s in seqs]
        self.extras = (StepExtras(seqs, self.params, self.guided.is_guided) if key.extras else None)
        if key.guided or key.pick:
            self.grammar.select_stream(key.captured)
        if seqs and (key.guided or key.pick):
            slots = [s.slot for s in seqs]
            ks = [len(d) for d in plan.drafts] if key.drafting is Drafting.HOST else list(plan.ks)
            self.grammar.begin(GuidedStep(slots=slots, guided=[self.guided.is_guided(s) for s in slots],
                                          drafting=key.drafting, ks=ks, picker=plan.picker if key.pick else None))

    def finish(self, key: StepKey) -> None:
        """Host waits for the step (GIL released) and for its grammar commit."""
        if self.out.buf.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        if key.guided or key.pick:
            self.grammar.step_done()

    def results(self, seqs: list[Sequence], plan: DraftPlan, key: StepKey) -> list[tuple[list[int], int, int]]:
        """Per row: (tokens to append: accepted drafts + the next token, drafts verified, drafts accepted)."""
        out = StepOutputs(self._stage_out.buf[:, : len(seqs)].tolist())
        lim = self.grammar.limits() if key.guided else []
        res = []
        for b, s in enumerate(seqs):
            a, nxt = out.accepted[b], out.next[b]
            if key.drafting is Drafting.NONE:
                n = 0
            else:  # drafts verified: the host's, or the row's budget of in-step drafts
                n = len(plan.drafts[b]) if key.drafting is Drafting.HOST else plan.ks[b]
            if lim and self.guided.is_guided(s.slot):
                n = min(n, lim[b])
            d = [out.drafts[i][b] for i in range(n)]
            res.append((d[:a] + [nxt], n, a))
        if self.extras is not None:
            self.extras.deliver([a + 1 for _, _, a in res])
            self.extras = None
        return res

    # ---- the step (capturable) -----------------------------------------------------------
    def ctx(self, key: StepKey, slots: torch.Tensor, positions: torch.Tensor, extra: int) -> AttnContext:
        length = key.length if key.captured else key.length + extra
        return self.model.make_context(slots, positions, self.slot_list, length)

    def body(self, key: StepKey) -> None:
        """The step on the static buffers; every shape depends only on `key`."""
        B, T = key.batch, key.T
        last, pos0, slots = self.inp.last[:B], self.inp.pos0[:B], self.inp.slot[:B]
        self.open(key)
        drafts = None
        if key.drafting.in_step:
            drafts = self._draft_loop(key, last, pos0, slots)
        elif key.drafting is Drafting.HOST:
            drafts = self.drafts_in[: T - 1, :B].t()
            self.out.drafts[: T - 1, :B].copy_(self.drafts_in[: T - 1, :B])
        ids = last[:, None] if drafts is None else torch.cat([last[:, None], drafts], dim=1)  # [B, T]
        positions = pos0[:, None] + self.arange[:T]
        self.tail(key, self.logits(key, self._verify(key, ids, positions, slots)), drafts)

    def _verify(self, key: StepKey, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The verification forward of ids [B, T] -> hidden [B, T, H]; the `riders`' prompt tokens go
        through the same forward (one weight pass), as rows of their own length (eager CPU steps)."""
        r = self.riders
        if r is None:
            hidden = self.model(ids, self.ctx(key, slots, positions, key.T - 1), self.kv)
            if self.feature_sink is not None:
                self.feature_sink(slots, positions, hidden)
            return hidden
        B, T = ids.shape
        n = B * T
        seg = torch.cat([torch.arange(0, n, T, device=ids.device), n + r.starts])  # [B + rows + 1]
        pos = torch.cat([positions.reshape(1, n), r.positions], dim=1)
        hidden = self.model(torch.cat([ids.reshape(1, n), r.ids], dim=1),
                            self.model.make_varlen_context(torch.cat([slots, r.slots]), pos, seg), self.kv)  # [1, N, H]
        if self.feature_sink is not None:
            H = hidden.shape[-1]
            self.feature_sink(torch.cat([slots.repeat_interleave(T), r.token_slots]), pos.view(-1, 1),
                              hidden.view(-1, 1, H))
        r.hidden = hidden[:, n:]
        return hidden[0, :n].view(B, T, -1)

    def logits(self, key: StepKey, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden [B, T, H] -> [B, T, V]. An eager guided CPU step whose rows are all
        masked computes only the output tiles (64 token ids each) some row's mask allows, when that
        leaves out enough of them: the others are banned in every row, so the masked logits, and the
        tokens and log probs from them, are the same bits (extras, which read unmasked logits, take
        every tile)."""
        if key.guided and not key.captured and not key.extras and self.sparse_lm_head:
            B, T = hidden.shape[:2]
            rows = (self.inp.slot[:B, None] * self.rows_per_slot + self.arange[:T]).reshape(-1)
            V = self.model.head.out_features
            tiles = self.grammar.mask_tiles(rows, V)
            if tiles is not None and tiles.numel() * SPARSE_HEAD_AT_MOST[1] <= SPARSE_HEAD_AT_MOST[0] * V // TILE:
                return self.model.logits(hidden, tiles, self._logits_out(key, hidden))
        return self.model.logits(hidden, out=self._logits_out(key, hidden))

    def _logits_out(self, key: StepKey, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """The static buffer's first B * T rows for an eager CPU step's logits (None elsewhere)."""
        if key.captured or hidden.device.type != "cpu":
            return None
        if self.logits_buf is None:
            self.logits_buf = torch.empty(self.kv.max_slots * self.rows_per_slot, self.model.head.out_features)
        n = hidden.shape[0] * hidden.shape[1]
        return self.logits_buf[:n] if n <= self.logits_buf.shape[0] else None

    def open(self, key: StepKey) -> None:
        """Grammar stream: fetch the snapshot, fill the first masks (overlapping the forwards)."""
        if key.guided or key.pick:
            self.grammar.launch_begin()

    def _draft_loop(self, key: StepKey, last: torch.Tensor, pos0: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """T - 1 greedy drafts [B, T-1]; each masked by its grammar row, fed to the matcher in a callback."""
        B, g, d = key.batch, self.grammar, self.drafter
        assert d is not None
        masked = key.guided and key.drafting is Drafting.MODEL
        cur = last[:, None]
        for i in range(key.T - 1):
            logits = d.draft(i, cur, pos0, slots, lambda p, e: self.ctx(key, slots, p, e))  # [B, Vd]
            if masked:
                g.apply_rows(logits, slots * self.rows_per_slot + i, d.d2t)
            tok = self._pick(key, i, logits, masked or key.pick)
            if masked or key.pick:
                g.launch_draft_advance(i)
            cur = tok[:, None]
        if key.guided:
            if not masked:  # the ablation: the callback walks the finished drafts
                self.out_host.drafts.copy_(self.out.drafts, non_blocking=key.captured)
            g.launch_draft_end()
        return self.out.drafts[: key.T - 1, :B].t()

    def _pick(self, key: StepKey, i: int, logits: torch.Tensor, to_host: bool) -> torch.Tensor:
        """Draft i's tokens [B] from the drafter's masked logits [B, Vd], written to out.drafts[i]
        (and out_host.drafts[i] for the grammar callbacks when `to_host`): its argmax (through d2t);
        the hybrid's pick: the grammar-forced / trusted n-gram token, else the n-gram when the
        drafter is unsure. On CPU one C call (kernels.draft_pick)."""
        B, d, g = key.batch, self.drafter, self.grammar
        assert d is not None
        props = g.proposals(B) if key.pick else None
        row = self.out.drafts[i, :B]
        if kernels.draft_pick(logits, d.d2t, props, HEAD_UNSURE, row, self.out_host.drafts[i, :B] if to_host else None):
            return row
        tok = kernels.argmax(logits)
        if d.d2t is not None:
            tok = d.d2t[tok]
        if props is not None:
            fixed, fallback = props
            unsure = logits.softmax(dim=-1).amax(dim=-1) < HEAD_UNSURE
            tok = torch.where(fixed >= 0, fixed, torch.where(unsure & (fallback >= 0), fallback, tok))
        row.copy_(tok)
        if to_host:
            self.out_host.drafts[i].copy_(self.out.drafts[i], non_blocking=key.captured)
        return tok

    def _sampler(self, key: StepKey, slots: torch.Tensor, counter: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """logits [B, T, V] -> [B, T]: the token a step without drafts samples at each position
        (the row's seed and the token's output index)."""
        def at_positions(logits: torch.Tensor) -> torch.Tensor:
            B, T, V = logits.shape
            rows = slots.repeat_interleave(T)
            cnt = (counter[:, None] + self.arange[:T]).reshape(-1)
            return sample(logits.view(B * T, V), self.params.batch(rows, cnt, key.greedy, key.truncated)).view(B, T)
        return at_positions

    def _num_drafts(self, key: StepKey, B: int) -> Optional[torch.Tensor]:
        """[B] drafts each row verifies (a guided row: at most its grammar's limit); None at T = 1."""
        if key.T == 1:
            return None
        num = self.inp.num[:B]
        return torch.minimum(num, self.grammar.limit_dev[:B].long()) if key.guided else num

    def _choose(self, key: StepKey, logits: torch.Tensor, drafts: Optional[torch.Tensor],
                num: Optional[torch.Tensor], ex: Optional[StepExtras]) -> None:
        """out.accepted / out.next from the masked logits [B, T, V] (num: `_num_drafts`): sampled or
        verified rows, extras."""
        B, T, _ = logits.shape
        slots, counter = self.inp.slot[:B], self.inp.counter[:B]
        if T == 1:
            nxt = sample(logits[:, 0], self.params.batch(slots, counter, key.greedy, key.truncated))
            accepted = torch.zeros_like(nxt)
        else:
            assert drafts is not None
            accepted, nxt = acceptance.verify(logits, drafts, num,
                                              None if key.greedy else self._sampler(key, slots, counter))
        if ex is not None:  # emitted[b, j]: the token position j produced
            emitted = nxt[:, None] if drafts is None else \
                torch.cat([drafts, nxt[:, None]], dim=1).scatter(1, accepted.long()[:, None], nxt[:, None])
            ex.after(logits, slots, emitted, nxt)
        nxt = torch.where(nonfinite_rows(logits).any(dim=1), BAD_TOKEN, nxt)
        self.out.accepted[:B].copy_(accepted)
        self.out.next[:B].copy_(nxt)

    def tail(self, key: StepKey, logits: torch.Tensor, drafts: Optional[torch.Tensor]) -> None:
        """Masks, acceptance and the next token from the verification logits [B, T, V]; outputs to
        `out` / `out_host`; the grammar commit."""
        B, T, V = logits.shape
        g, ex = self.grammar, self.extras if key.extras else None
        slots = self.inp.slot[:B]
        if ex is not None:
            ex.before(logits)
        if key.biased:
            self.params.add_bias(logits, slots)
        if key.guided:
            g.apply_rows(logits.view(B * T, V), (slots[:, None] * self.rows_per_slot + self.arange[:T]).reshape(-1))
        if ex is not None:
            ex.process(logits[:, 0], slots)
        num = self._num_drafts(key, B)
        # greedy rows on CPU: the argmaxes, the acceptance and the non-finite check in one scan
        if not (key.greedy and ex is None and kernels.greedy_verify(
                logits, drafts, num, self.out.accepted[:B], self.out.next[:B], BAD_TOKEN)):
            self._choose(key, logits, drafts, num, ex)
        self.out_host.buf.copy_(self.out.buf, non_blocking=key.captured)
        if key.guided or key.pick:
            g.launch_commit()  # feeds drafts[:accepted] + next (from out_host) to the matchers
            g.join()  # the forward stream waits for the grammar stream: no unjoined capture work
