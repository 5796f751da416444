"""CapturableRunner: the Runner with its grammar work done by a CapturableGuidedDecoder.

Every step that masks logits opens a `GuidedStep` (host snapshot) before its forward, so the
grammar callbacks (fill, per-draft advance, rollback) run on the grammar stream while the
forward runs, and ends with a `commit` callback that feeds the emitted tokens to the matchers.
Token for token the same as the plain Runner + GuidedDecoder (tests/guided/test_capturable.py).
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import EngineConfig
from .cuda import hostfunc
from .guided.capturable import CapturableGuidedDecoder
from .guided.decoder import GuidedDecoder
from .models.llama import LlamaModel
from .runner import Pick, Runner
from .scheduler import Sequence

EXECUTORS = ("auto", "plain", "inline", "worker", "cuda")


def resolve_executor(config: EngineConfig, device: torch.device) -> str:
    kind = config.guided_executor
    if kind == "auto":
        return "cuda" if device.type == "cuda" else "plain"
    if kind == "cuda" and device.type != "cuda":
        raise ValueError("guided_executor 'cuda' needs a CUDA device")
    return kind


def build_runner(model: LlamaModel, config: EngineConfig, device: torch.device, vocab: int
                 ) -> tuple[GuidedDecoder | CapturableGuidedDecoder, Runner]:
    """The guided decoder and runner that `config.guided_executor` asks for."""
    plain = GuidedDecoder(config.max_slots, config.num_draft_tokens, vocab, num_threads=config.guided_mask_threads)
    kind = resolve_executor(config, device)
    if kind == "plain":
        return plain, Runner(model, config, device, plain)
    guided = CapturableGuidedDecoder(plain, hostfunc.make_stream(kind), device)
    return guided, CapturableRunner(model, config, device, guided)


class CapturableRunner(Runner):
    """Runner whose guided rows go through the CapturableGuidedDecoder's step protocol."""

    guided: CapturableGuidedDecoder

    def __init__(self, model: LlamaModel, config: EngineConfig, device: torch.device,
                 guided: CapturableGuidedDecoder):
        super().__init__(model, config, device, guided)  # type: ignore[arg-type]
        # NOTE: on CUDA, eager steps launch the fill just before masking (no callback pending
        # behind a GIL-held sync); overlap on CUDA comes from the captured step (cuda/graphs.py)
        self.prelaunch = not guided.on_cuda

    def _any_guided(self, seqs: list[Sequence]) -> bool:
        return any(self.guided.is_guided(s.slot) for s in seqs)

    # ---- plain decode and prefill: row 0 -------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> list[int]:
        if self.prelaunch and self._any_guided(seqs):
            self._open([s.slot for s in seqs])  # the fill overlaps the forward
        return super().decode(seqs)

    def _open(self, slots: list[int]) -> None:
        """Begin a step unless one is open for this batch (drafting filled row 0 already)."""
        st = self.guided.step
        if st is None or st.slots != slots:
            self.guided.begin(slots)

    def _mask_grammar(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if not self._any_guided(seqs):
            return
        self._open([s.slot for s in seqs])
        self.guided.apply(logits, [(s.slot, 0) for s in seqs])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = super()._sample(logits, seqs)
        if self.guided.step is not None:
            self._commit([[t] for t in tokens])
        return tokens

    def _commit(self, tokens: list[list[int]]) -> None:
        self.guided.launch_commit(tokens)
        if not self.prelaunch:  # eager CUDA: wait now (GIL released), see hostfunc's NOTE
            self.guided.wait_commit()

    # ---- speculative steps ---------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, seqs: list[Sequence], drafts: list[list[int]], masks_filled: bool = False
               ) -> list[tuple[list[int], int]]:
        if self.prelaunch and not masks_filled and self._any_guided(seqs):
            self.guided.begin([s.slot for s in seqs], drafts=drafts)  # walks the drafts during the forward
        out = super().verify(seqs, drafts, masks_filled)
        if self.guided.step is not None:
            self._commit([toks for toks, _ in out])
        return out

    def _mask_verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]],
                     masks_filled: bool) -> list[list[int]]:
        T = logits.shape[0] // len(seqs)
        if not masks_filled:
            if self.guided.step is None:
                self.guided.begin([s.slot for s in seqs], drafts=drafts)
            lim = self.guided.limits()
            drafts = [d[: min(len(d), n)] for d, n in zip(drafts, lim)]
        self.guided.apply(logits, [(s.slot, i) for s in seqs for i in range(T)])
        return drafts

    @torch.inference_mode()
    def draft_greedy(self, seqs: list[Sequence], ks: list[int], step, masked: bool = True,
                     d2t: Optional[torch.Tensor] = None, pick: Optional[Pick] = None) -> list[list[int]]:
        """As Runner.draft_greedy; the grammar walks each draft in a callback (row i + 1 is
        filled while the host goes on), and the drafts are cut at the published limits."""
        if not masked or not self._any_guided(seqs):
            return super().draft_greedy(seqs, ks, step, masked=False, d2t=d2t, pick=pick)
        K = max(ks)
        slot_list = [s.slot for s in seqs]
        self.guided.begin(slot_list, ks=ks)
        tokens: list[list[int]] = []
        prev = [s.last_token for s in seqs]
        for i in range(K):
            logits = step(i, prev)
            self.guided.apply(logits, [(s, i) for s in slot_list], d2t=d2t)
            ids = logits.argmax(dim=-1)
            toks = (ids if d2t is None else d2t[ids]).tolist()
            if pick is not None:
                toks = pick(i, toks, logits)
            tokens.append(toks)
            self.guided.launch_draft_advance(i, toks)
            prev = toks
        self.guided.launch_draft_end()
        lim = self.guided.limits()
        return [[tokens[i][b] for i in range(min(k, n))] for b, (k, n) in enumerate(zip(ks, lim))]


def close(guided: Optional[object]) -> None:
    """Stop a capturable decoder's worker thread (no-op for the plain decoder)."""
    fn = getattr(guided, "close", None)
    if fn is not None:
        fn()
