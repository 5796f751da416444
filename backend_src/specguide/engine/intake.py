"""Request intake: check a `Request` against the engine's limits, build its `Sequence`, and hand it its
compiled grammar once ready (the one writer of `seq.guide`, sequence_state.GuideState)."""
from __future__ import annotations

import itertools
import json
import logging
import math
import random
from typing import Any, Callable, Iterable

from ..config import EngineConfig
from ..guided.budget import completion_cap, within_budget
from ..guided.json_scanner import Scanner
from ..guided.params import normalize_structural_tag
from ..guided.regex_completion import RegexScanner
from ..guided.schema_completion import Schemas
from ..guided.tag_completion import TagScanner
from ..guided.reasoning import Reasoning
from ..models.lora import AdapterError, adapter_from_trtllm
from ..request import InvalidRequestError, ListLimits, Request, RequestOutput, SamplingParams, check_token_ids, error_code
from .scheduler import Sequence
from .sequence_state import GuideState, OutputState
from ..tokenizer import Tokenizer

log = logging.getLogger("specguide")


class Intake:
    """Validates requests (InvalidRequestError names what is wrong), numbers their sequences and
starts, then collects, their grammar compiles."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_size: int,
                 eos_token_ids: frozenset[int], compiler: Any, adapters: Any = None):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.compiler = compiler  # starts a guided request's grammar compile
        self.adapters = adapters  # the LoRA adapters served (engine/lora_adapters.py), for their names
        self.lists = ListLimits.from_config(config)  # the per-token lists' caps (the stub checks them first)
        self._ids = itertools.count(1)
        markers = config.reasoning()  # reasoning models: guides wait for the end marker
        self.reasoning = None if markers is None else Reasoning.for_tokenizer(
            markers, tokenizer.hf, eos_token_ids, vocab_size)

    def _prompt_ids(self, request: Request) -> list[int]:
        if request.prompt_ids is not None:
            ids = [int(t) for t in request.prompt_ids]
            check_token_ids(ids, "input_ids", self.vocab_size)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise InvalidRequestError("a request needs a prompt (text_input) or input_ids")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.config.max_seq_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; max_seq_len is {self.config.max_seq_len} "
                f"(the prompt must leave room for at least one generated token)")
        return ids

    def sequence(self, request: Request, callback: Callable[[RequestOutput], None]) -> Sequence:
        """The request's Sequence (its grammar compile started); raises InvalidRequestError."""
        cfg, vocab = self.config, self.vocab_size
        ids = self._prompt_ids(request)
        p = request.params
        p.validate(cfg.max_tokens_limit, vocab, self.lists)  # every id in the vocabulary, the lists within their caps
        p.normalize(vocab)
        self._check_logits(p, len(ids))
        k = request.num_draft_tokens
        if k is not None and not 0 <= k <= cfg.num_draft_tokens:
            raise InvalidRequestError(f"num_draft_tokens must be in [0, {cfg.num_draft_tokens}] "
                                      f"(the configured maximum), got {k}")
        timeout = request.timeout_s if request.timeout_s is not None else cfg.request_timeout_s
        if not (timeout >= 0 and math.isfinite(timeout)):
            raise InvalidRequestError(f"timeout_s must be a finite number >= 0 (0 = none), got {timeout}")
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= {p.end_id} if p.end_id is not None else set(self.eos_token_ids)
        seq = Sequence(
            seq_id=next(self._ids), prompt_ids=ids, params=p,
            seed=p.seed if p.seed is not None else random.getrandbits(64), callback=callback,
            stop_ids=frozenset(stop_ids), num_draft_tokens=cfg.num_draft_tokens if k is None else k,
            request_id=request.request_id,
            out=OutputState(), guide=GuideState(params=request.guided))
        seq.group = request.group if request.group is not None else -seq.seq_id  # (<= 0: apart from the client's)
        lora = request.lora_name
        if request.lora_task_id is not None or request.lora_weights is not None or request.lora_config is not None:
            lora = self._task(request)
        if lora is not None:
            if self.adapters is None:
                raise InvalidRequestError(f"LoRA adapter {lora!r}: this engine serves none")
            seq.adapter, seq.adapter_key = lora, self.adapters.key(lora)
        if timeout > 0:
            seq.deadline = seq.stats.arrival + timeout
        if request.guided is not None:  # a malformed guide raises here; compile errors come later
            seq.guide.compile = self.compiler.submit(request.guided)
        return seq

    def _task(self, request: Request) -> str:
        """A TensorRT-LLM LoRA task (its weights cached the first time): the name it runs under."""
        if request.lora_task_id is None:
            raise InvalidRequestError("lora_weights and lora_config need a lora_task_id (the id later requests name)")
        if (request.lora_weights is None) != (request.lora_config is None):
            raise InvalidRequestError("lora_weights and lora_config come together")
        if request.lora_name is not None:
            raise InvalidRequestError("a request names one LoRA adapter: lora_name or lora_task_id, not both")
        if self.adapters is None:
            raise InvalidRequestError("LoRA tasks: this engine serves no adapters")
        adapter = None
        if request.lora_weights is not None:
            try:
                adapter = adapter_from_trtllm(str(request.lora_task_id), request.lora_weights, request.lora_config,
                                              self.adapters.model.cfg, self.adapters.lora_dtype,
                                              self.adapters.model.device)
            except AdapterError as exc:
                raise InvalidRequestError(str(exc)) from None
        return self.adapters.put_task(request.lora_task_id, adapter)

    def _check_logits(self, p: SamplingParams, prompt_len: int) -> None:
        """The logits a request asks for (held until sent: a prompt's all at once) within
        max_logits_bytes: a client must not make the engine hold gigabytes (8,192 x 49,152 floats:
        1.6 GB)."""
        limit = self.config.max_logits_bytes
        rows = (prompt_len if p.return_context_logits else 0) + \
            (min(p.max_tokens, self.config.max_seq_len - prompt_len) if p.return_generation_logits else 0)
        if limit and rows * self.vocab_size * 4 > limit:
            what = " and ".join(w for w, on in ((f"return_context_logits ({prompt_len} prompt tokens)", p.return_context_logits),
                                                (f"return_generation_logits (max_tokens {p.max_tokens})",
                                                 p.return_generation_logits)) if on)
            raise InvalidRequestError(f"{what} asks for {rows} x {self.vocab_size} logits, "
                                      f"{rows * self.vocab_size * 4 / 2**20:.0f} MiB as float32; max_logits_bytes is "
                                      f"{limit / 2**20:.0f} MiB (a shorter prompt or fewer max_tokens fit)")

    def _within_budget(self, seq: Sequence) -> Any:
        """A JSON, regex or tool-call guide whose answer must close before max_tokens (guided/budget.py);
        InvalidRequestError when no valid answer fits. Not with ignore_eos or min_tokens (the stop token may not come
        when the budget needs it), nor for reasoning models (the guide's start is not known)."""
        guide, g, p = seq.guide.grammar, seq.guide.params, seq.params
        if not g.complete_within_budget or g.guide_type not in ("json", "json_schema", "regex", "structural_tag") \
                or p.min_tokens:
            return guide
        stops = [t for t in self.compiler.stop_token_ids if t in seq.stop_ids]
        if not stops:
            return guide
        budget = min(p.max_tokens, self.config.max_seq_len - len(seq.prompt_ids))
        cap = completion_cap(budget, self.compiler.token_bytes)
        return within_budget(guide, self._scanner(g.guide_type, g.guide, guide, cap), budget,
                             self.compiler.token_bytes, self.tokenizer.encode, stops[0])

    def _scanner(self, guide_type: str, text: str, guide: Any, cap: int) -> Callable[[], Any]:
        """The budget's reader of the answer so far (guided/budget.py), made when the guide is; it
        builds no completion longer than `cap` bytes (what the budget could hold)."""
        if guide_type == "regex":
            return lambda: RegexScanner(text, cap)
        if guide_type == "structural_tag":
            return lambda: TagScanner(normalize_structural_tag(json.loads(text)), self.compiler.token_bytes,
                                      self.tokenizer.encode, cap)
        return lambda: Scanner(Schemas(guide.schema, cap))

    def poll_compiles(self, waiting: Iterable[Sequence]) -> list[tuple[Sequence, str, str]]:
        """Move finished grammar compiles onto their sequences; returns (sequence, error message,
        error code) for each compile that failed (the engine fails those requests)."""
        failed = []
        for seq in [q for q in waiting if q.guide.compile is not None]:
            state, handle = seq.guide, seq.guide.compile
            if not (handle.ready() or handle.timed_out()):
                continue
            try:
                state.grammar = handle.result(timeout=0)
                state.compile = None
                if self.reasoning is not None:
                    state.grammar = self.reasoning.wrap(state.grammar, seq.prompt_ids)
                else:
                    state.grammar = self._within_budget(seq)
            except InvalidRequestError as exc:
                failed.append((seq, str(exc), error_code(exc)))
            except Exception as exc:
                log.error("grammar compile of request %s failed: %r", seq.seq_id, exc)
                failed.append((seq, f"the grammar compile failed ({type(exc).__name__}; "
                                    f"the server log has the details)", "INTERNAL"))
        return failed

    def release(self, seq: Sequence) -> None:
        """A finishing request's compile, if it still runs, is cancelled."""
        if seq.guide.compile is not None:
            seq.guide.compile.cancel()
            seq.guide.compile = None
