"""Model runner: prefill chunks and batched decode steps over the static per-slot KV cache."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from . import faults
from .config import EngineConfig
from .guided.decoder import GuidedDecoder
from .kv_cache import KVCache
from .models.llama import LlamaModel
from .sampling import SamplingBatch, log_probs, probabilities, sample
from .speculative import acceptance
from .scheduler import PrefillChunk, Sequence

NEG_INF = float("-inf")
Pick = Callable[[int, list[int], torch.Tensor], list[int]]  # (draft position, argmax tokens, logits) -> tokens
BAD_TOKEN = -1  # returned for a row whose logits hold NaN or +inf: the engine fails that request only


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] bool: the row holds NaN or +inf (-inf is a mask). No host sync: the flag
    rides along with the tokens, which are copied to the host anyway."""
    top = logits.amax(dim=-1)  # NaN propagates
    return top.isnan() | top.isposinf()


class Runner:
    """Owns the model, the KV cache and per-slot sampling buffers (allocated once, indexed by slot)."""

    def __init__(self, model: LlamaModel, config: EngineConfig, device: torch.device,
                 guided: Optional[GuidedDecoder] = None):
        cfg = model.cfg
        self.guided = guided
        self.model = model
        self.device = device
        self.vocab_size = cfg.vocab_size
        dtype = model.embed.weight.dtype
        self.K = config.num_draft_tokens
        self.draft_layers = min(config.draft_layers, cfg.num_layers)
        self.kv = KVCache(cfg.num_layers, config.max_slots, cfg.num_kv_heads, config.max_seq_len,
                          cfg.head_dim, dtype, device, spare=self.K + 1)  # +1: CUDA-graph padding rows
        S = config.max_slots
        # per-slot sampling parameters, written on admission
        self.temperature = torch.ones(S, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(S, dtype=torch.int64, device=device)
        self.top_p = torch.ones(S, dtype=torch.float32, device=device)
        self.greedy = torch.ones(S, dtype=torch.bool, device=device)
        self.seed = torch.zeros(S, dtype=torch.int64, device=device)
        # penalties: [slots] parameters, [slots, V] output-token counts and prompt+output presence
        self.rep_penalty = torch.ones(S, dtype=torch.float32, device=device)
        self.presence = torch.zeros(S, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(S, dtype=torch.float32, device=device)
        self.counts = torch.zeros(S, cfg.vocab_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros(S, cfg.vocab_size, dtype=torch.bool, device=device)
        self._penalized: set[int] = set()  # slots whose requests use a penalty
        self._slot_params: dict[int, tuple[bool, bool]] = {}  # slot -> (greedy, uses top-k/top-p)
        # called with (slots [B], positions [B, T], final hidden [B, T, H]) after target forwards
        self.feature_sink: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]] = None

    def bind(self, seq: Sequence) -> None:
        """Write a newly admitted sequence's sampling parameters into its slot row."""
        s, p = seq.slot, seq.params
        assert s is not None
        self.temperature[s] = p.temperature if p.temperature > 0 else 1.0
        self.top_k[s] = p.top_k
        self.top_p[s] = p.top_p
        self.greedy[s] = p.greedy
        self.seed[s] = seq.seed - 2**64 if seq.seed >= 2**63 else seq.seed  # uint64 bits as int64
        self._slot_params[s] = (p.greedy, p.top_k > 1 or p.top_p < 1.0)
        self.rep_penalty[s] = p.repetition_penalty  # neutral values for unpenalized requests
        self.presence[s] = p.presence_penalty
        self.frequency[s] = p.frequency_penalty
        self._penalized.discard(s)
        if p.penalized:
            self._penalized.add(s)
            self.counts[s].zero_()
            self.seen[s].zero_()
            self.seen[s, torch.tensor(seq.prompt_ids, device=self.device)] = True

    # ---- forward passes ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, chunk: PrefillChunk) -> Optional[int]:
        """Run one prompt chunk; returns the first output token when the chunk ends the prompt."""
        seq = chunk.seq
        ids = torch.tensor([seq.prompt_ids[chunk.start: chunk.end]], dtype=torch.int64, device=self.device)
        positions = torch.arange(chunk.start, chunk.end, device=self.device)[None, :]
        slots = torch.tensor([seq.slot], device=self.device)
        ctx = self.model.make_context(slots, positions, [seq.slot], chunk.end)
        hidden = self.model(ids, ctx, self.kv)
        if self.feature_sink is not None:
            self.feature_sink(slots, positions, hidden)
        if seq.params.return_context_logits:  # raw logits of every prompt position, for this request only
            full = self.model.logits(hidden[0])  # [n, V]
            seq.context_logits.append(full.to("cpu", torch.float32, copy=True))
            logits = full[-1:] if chunk.is_last else None
        elif chunk.is_last:
            logits = self.model.logits(hidden[:, -1])  # [1, V]
        if not chunk.is_last:
            return None
        return self._sample(logits, [seq])[0]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[int]:
        """One token for each decoding sequence (sorted by slot), in one batched forward."""
        slot_list = [s.slot for s in seqs]
        ids = torch.tensor([[s.last_token] for s in seqs], dtype=torch.int64, device=self.device)
        positions = torch.tensor([[s.num_tokens - 1] for s in seqs], dtype=torch.int64, device=self.device)
        slots = torch.tensor(slot_list, device=self.device)
        ctx = self.model.make_context(slots, positions, slot_list, max(s.num_tokens for s in seqs))
        hidden = self.model(ids, ctx, self.kv)
        if self.feature_sink is not None:
            self.feature_sink(slots, positions, hidden)
        logits = self.model.logits(hidden[:, -1])  # [B, V]
        return self._sample(logits, seqs)

    # ---- speculative decoding ---------------------------------------------------------------
    @torch.inference_mode()
    def draft_early_exit(self, seqs: list[Sequence], ks: list[int], masked: bool = True) -> list[list[int]]:
        """Greedy drafts from the target's first `draft_layers` layers + final norm + LM head
        (their KV is the target's own)."""
        def step(cur: torch.Tensor, ctx) -> torch.Tensor:
            return self.model.logits(self.model(cur, ctx, self.kv, num_layers=self.draft_layers)[:, -1])
        return self.draft_greedy(seqs, ks, self.chained(seqs, step), masked)

    def chained(self, seqs: list[Sequence], step: Callable) -> Callable[[int, list[int]], torch.Tensor]:
        """Adapt `step(tokens [B, 1], ctx) -> logits` of a model with its own KV for draft_greedy:
        draft position i feeds the previous tokens at position N-1+i."""
        slot_list = [s.slot for s in seqs]
        slots = torch.tensor(slot_list, device=self.device)
        pos0 = torch.tensor([[s.num_tokens - 1] for s in seqs], device=self.device)
        length = max(s.num_tokens for s in seqs)

        def run(i: int, prev: list[int]) -> torch.Tensor:
            cur = torch.tensor([[t] for t in prev], device=self.device)
            return step(cur, self.model.make_context(slots, pos0 + i, slot_list, length + i))
        return run

    @torch.inference_mode()
    def draft_greedy(self, seqs: list[Sequence], ks: list[int], step: Callable[[int, list[int]], torch.Tensor],
                     masked: bool = True, d2t: Optional[torch.Tensor] = None, pick: Optional[Pick] = None
                     ) -> list[list[int]]:
        """Up to ks[b] greedy drafts per sequence from `step(i, previous tokens) -> logits [B, V']`
        (i = 0 gets the last tokens). `d2t` [V'] maps a pruned draft vocabulary to target ids.
        `pick(i, argmax tokens, masked logits) -> tokens`, when given, may replace a row's token
        (grammar-forced or n-gram tokens; the model still reads them, so its later drafts follow).
        Guided slots mask each draft with mask row i, which the verification then reuses; a
        draft the grammar rejects ends that slot's drafting. `masked=False` drafts without masks
        (the verification fills them)."""
        K = max(ks)
        guided = self.guided if masked else None
        prev = [s.last_token for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        live = [k > 0 for k in ks]
        for i in range(K):
            logits = step(i, prev)
            rows = [(s.slot, i) for s in seqs]
            if guided is not None:
                g = [r for r, s, ok in zip(rows, seqs, live) if ok and guided.is_guided(s.slot)]
                if g:
                    guided.fill(g)
                    guided.apply(logits, rows, d2t=d2t)
            ids = logits.argmax(dim=-1)
            tokens = (ids if d2t is None else d2t[ids]).tolist()
            if pick is not None:
                tokens = pick(i, tokens, logits)
            for b, seq in enumerate(seqs):
                if not live[b]:
                    continue
                if guided is not None and guided.is_guided(seq.slot):
                    if not guided.advance(seq.slot, tokens[b]):
                        live[b] = False  # grammar dead end: stop drafting, not an error
                        continue
                drafts[b].append(tokens[b])
                live[b] = len(drafts[b]) < ks[b] and not (
                    guided is not None and guided.is_guided(seq.slot) and guided.is_terminated(seq.slot))
            if not any(live):
                break
            prev = tokens
        if guided is not None:  # masks of the position after the last draft; then undo the drafts
            g = [(s.slot, len(d)) for s, d in zip(seqs, drafts) if guided.is_guided(s.slot)]
            guided.fill(g)
            for s, d in zip(seqs, drafts):
                if guided.is_guided(s.slot):
                    guided.rollback(s.slot, len(d))
        return drafts

    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]], masks_filled: bool = False
               ) -> list[tuple[list[int], int]]:
        """One target forward over [last, d_0..d_{k-1}] for every slot (padded to the longest);
        returns per sequence (tokens to emit: accepted drafts + one corrected/bonus token, drafts
        accepted). Guided slots: masks for rows 0..k come from the matcher walking the drafts
        (filled here unless the drafter already did); the matcher is left where it started."""
        B = len(seqs)
        K = max(len(d) for d in drafts)
        T = K + 1
        slot_list = [s.slot for s in seqs]
        slots = torch.tensor(slot_list, device=self.device)
        ids = torch.tensor([[s.last_token] + d + [s.last_token] * (K - len(d)) for s, d in zip(seqs, drafts)],
                           device=self.device)  # [B, T]; padded drafts write dead KV past the length
        positions = torch.tensor([s.num_tokens - 1 for s in seqs], device=self.device)[:, None] + \
            torch.arange(T, device=self.device)[None, :]
        ctx = self.model.make_context(slots, positions, slot_list, max(s.num_tokens for s in seqs) + K)
        hidden = self.model(ids, ctx, self.kv)
        if self.feature_sink is not None:
            self.feature_sink(slots, positions, hidden)
        logits = self.model.logits(hidden)  # [B, T, V]
        raw = self._raw_rows(logits, seqs)
        if faults.enabled():
            faults.poison(logits, seqs)
        if self.guided is not None and any(self.guided.is_guided(s) for s in slot_list):
            drafts = self._mask_verify(logits.view(B * T, -1), seqs, drafts, masks_filled)
        penalized = any(s in self._penalized for s in slot_list)
        first = logits[:, 0]  # speculation-ineligible rows (bans, penalties) only use position 0
        if penalized:
            first.copy_(self._penalize(first, slots))
        self._ban(first, seqs)
        num = torch.tensor([len(d) for d in drafts], device=self.device)
        dr = torch.tensor([d + [0] * (K - len(d)) for d in drafts], dtype=torch.int64, device=self.device)
        flags = [self._slot_params[s.slot] for s in seqs]
        if all(g for g, _ in flags):
            target = logits.argmax(dim=-1)  # [B, T]
            ok = (dr == target[:, :K]) & (torch.arange(K, device=self.device)[None, :] < num[:, None])
            accepted = ok.int().cumprod(dim=1).sum(dim=1)
            nxt = target.gather(1, accepted[:, None])[:, 0]
        else:
            rows = slots.repeat_interleave(T)
            counter = torch.tensor([len(s.output_ids) for s in seqs], device=self.device)
            batch = self._sampling_batch(rows, (counter[:, None] + torch.arange(T, device=self.device)).reshape(-1),
                                         flags)
            p = probabilities(logits.view(B * T, -1), batch).view(B, T, -1)
            u_acc, u_res = acceptance.uniforms(self.seed[slots], counter, K, p.shape[-1])
            accepted, nxt = acceptance.verify(p, dr, num, u_acc, u_res)
        lp = None
        if any(s.params.wants_logprobs for s in seqs):  # emitted[b, j]: the token position j produced
            emitted = torch.cat([dr, nxt[:, None]], dim=1).scatter(1, accepted.long()[:, None], nxt[:, None])
            lp = self._logprob_rows(logits, seqs, slots, emitted)
        if penalized:
            self._count(slots, nxt)
        nxt = torch.where(nonfinite_rows(logits).any(dim=1), BAD_TOKEN, nxt)
        acc_list, nxt_list = accepted.tolist(), nxt.tolist()
        self._deliver(seqs, lp, raw, [a + 1 for a in acc_list])
        return [(d[:a] + [t], a) for d, a, t in zip(drafts, acc_list, nxt_list)]

    def _mask_verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                     masks_filled: bool) -> list[list[int]]:
        """Grammar masks on verification logits [B*T, V] (row b*T + i: slot of seqs[b], position i),
        filled here by walking the drafts unless the drafter did; returns the drafts cut at the
        first one the grammar rejects. The matchers end where they started."""
        T = logits.shape[0] // len(seqs)
        if not masks_filled:
            fed = self.guided.fill_verify_rows({s.slot: d for s, d in zip(seqs, drafts)})
            drafts = [d[: fed[s.slot]] if s.slot in fed else d for s, d in zip(seqs, drafts)]
            for s in seqs:
                if s.slot in fed:
                    self.guided.rollback(s.slot, fed[s.slot])
        self.guided.apply(logits, [(s.slot, i) for s in seqs for i in range(T)])
        return drafts

    # ---- sampling ---------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        slots = torch.tensor([s.slot for s in seqs], device=self.device)
        raw = self._raw_rows(logits[:, None], seqs)
        if faults.enabled():
            faults.poison(logits, seqs)
        penalized = any(s.slot in self._penalized for s in seqs)
        if penalized:
            logits = self._penalize(logits, slots)
        self._ban(logits, seqs)
        self._mask_grammar(logits, seqs)
        tokens = self._draw(logits, seqs, slots)
        lp = self._logprob_rows(logits[:, None], seqs, slots, tokens[:, None])
        if penalized:  # count what was drawn (every drawn token is appended in plain decoding)
            self._count(slots, tokens)
        out = torch.where(nonfinite_rows(logits), BAD_TOKEN, tokens).tolist()
        self._deliver(seqs, lp, raw, [1] * len(seqs))
        return out

    # ---- per-token outputs, computed only for the sequences that ask ----------------------
    def _raw_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> Optional[tuple[list[int], torch.Tensor]]:
        """(indices, a copy of their raw logits [n, T, V]) of the sequences that want generation
        logits; taken before penalties, bans and masks change `logits` [B, T, V] in place."""
        idx = [b for b, s in enumerate(seqs) if s.params.return_generation_logits]
        if not idx:
            return None
        return idx, logits[torch.tensor(idx, device=logits.device)]  # advanced indexing: a copy

    def _logprob_rows(self, logits: torch.Tensor, seqs: list[Sequence], slots: torch.Tensor,
                      emitted: torch.Tensor) -> Optional[tuple[list[int], torch.Tensor, Optional[tuple]]]:
        """For the sequences that want log probabilities: (indices, log p of the emitted tokens
        [n, T], top-N (values, ids) [n, T, N] or None) from the processed logits [B, T, V]
        (penalties, bans and grammar masks applied) and the emitted tokens [B, T]. p is the
        distribution the token is drawn from (sampling.log_probs); under rejection sampling the
        target's p at that position. No host sync: the results ride along with the tokens."""
        idx = [b for b, s in enumerate(seqs) if s.params.wants_logprobs]
        if not idx:
            return None
        sel = torch.tensor(idx, device=logits.device)
        lg = logits[sel]
        n, T, V = lg.shape
        rows = slots[sel].repeat_interleave(T)
        batch = self._sampling_batch(rows, torch.zeros_like(rows), [self._slot_params[seqs[b].slot] for b in idx])
        lp = log_probs(lg.reshape(n * T, V), batch).view(n, T, V)
        tok = lp.gather(-1, emitted[sel].clamp_min(0)[..., None])[..., 0]
        N = max(seqs[b].params.top_logprobs for b in idx)
        return idx, tok, (lp.topk(N, dim=-1) if N else None)

    @staticmethod
    def _deliver(seqs: list[Sequence], lp, raw, counts: list[int]) -> None:
        """Leave the per-token outputs of each asking sequence's first counts[b] emitted tokens in
        its step_* fields (the engine keeps those of the tokens it appends)."""
        if lp is not None:
            idx, tok, top = lp
            tok = tok.tolist()
            vals, ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
            for i, b in enumerate(idx):
                seq, n, N = seqs[b], counts[b], seqs[b].params.top_logprobs
                seq.step_logprobs = tok[i][:n]
                seq.step_top_logprobs = [list(zip(ids[i][j][:N], vals[i][j][:N])) for j in range(n)] if N else None
        if raw is not None:
            idx, rows = raw
            for i, b in enumerate(idx):
                seqs[b].step_logits = rows[i, :counts[b]].to("cpu", torch.float32)

    def _count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record emitted tokens [B] of slots [B] for the penalties."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen[slots, tokens] = True

    def _penalize(self, logits: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Repetition (divide positive / multiply negative logits of seen tokens), presence and
        frequency penalties; rows of unpenalized slots have neutral parameters."""
        rp = self.rep_penalty[slots][:, None]
        counts = self.counts[slots].float()  # [B, V]
        scaled = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(self.seen[slots], scaled, logits)
        return logits - counts * self.frequency[slots][:, None] - (counts > 0).float() * self.presence[slots][:, None]

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], slots: torch.Tensor) -> torch.Tensor:
        flags = [self._slot_params[s.slot] for s in seqs]
        if all(g for g, _ in flags):
            return logits.argmax(dim=-1)
        counter = torch.tensor([len(s.output_ids) for s in seqs], device=self.device)
        return sample(logits, self._sampling_batch(slots, counter, flags))

    def _sampling_batch(self, rows: torch.Tensor, counter: torch.Tensor, flags: list[tuple[bool, bool]]
                        ) -> SamplingBatch:
        """Sampling parameters of slot rows `rows` (a slot may repeat) from the per-slot buffers."""
        return SamplingBatch(
            temperature=self.temperature[rows], top_k=self.top_k[rows], top_p=self.top_p[rows],
            greedy=self.greedy[rows], seed=self.seed[rows], counter=counter,
            all_greedy=all(g for g, _ in flags), any_top_k_p=any(f for g, f in flags if not g))

    def _mask_grammar(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Fill the guided rows' masks from their matchers' state and apply them (row = (slot, 0))."""
        if self.guided is None:
            return
        rows = [(s.slot, 0) for s in seqs]
        guided = [r for r in rows if self.guided.is_guided(r[0])]
        if guided:
            self.guided.fill(guided)
            self.guided.apply(logits, rows)

    def _ban(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf for stop tokens before min_tokens and for the last token of matching bad words.
        Guided rows keep their stop tokens: the grammar decides where the output ends."""
        rows: list[int] = []
        toks: list[int] = []
        for r, seq in enumerate(seqs):
            guided = self.guided is not None and self.guided.is_guided(seq.slot)
            if len(seq.output_ids) < seq.params.min_tokens and not guided:
                rows += [r] * len(seq.stop_ids)
                toks += list(seq.stop_ids)
            for word in seq.params.bad_words_ids:
                prefix = word[:-1]
                n = len(seq.output_ids)
                if n >= len(prefix) and seq.output_ids[n - len(prefix):] == prefix:
                    rows.append(r)
                    toks.append(word[-1])
        if rows:
            logits[torch.tensor(rows), torch.tensor(toks)] = NEG_INF

    @torch.inference_mode()
    def warmup(self) -> None:
        """One tiny forward so the first request does not pay for lazy initialisation."""
        slots = torch.tensor([0], device=self.device)
        ctx = self.model.make_context(slots, torch.zeros(1, 1, dtype=torch.int64, device=self.device), [0], 1)
        self.model.logits(self.model(torch.zeros(1, 1, dtype=torch.int64, device=self.device), ctx, self.kv))
