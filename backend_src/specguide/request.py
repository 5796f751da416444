"""Request messages: sampling parameters, guided-decoding parameters, output events."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import numpy as np


MAX_TOP_LOGPROBS = 20
PromptLogprob = tuple[int, Optional[float], list[tuple[int, float]]]  # (token id, log p, top N); the first: None, []
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (a static [slots, 300] table on the device)
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS)
MIN_TEMPERATURE = 1e-2  # temperatures in [1e-5, 1e-2) are raised to this (vLLM's _MAX_TEMP): finite logits
REPETITION_PENALTY_RANGE = (1e-2, 1e2)  # logits / 0.01 stay finite in fp32; vLLM only asks > 0


class InvalidRequestError(ValueError):
    """A request the engine refuses (INVALID_ARG)."""

    code = "INVALID_ARG"  # the Triton error code name a client gets


def limit_exceeded(what: str, n: int, unit: str, limit: int, setting: str) -> InvalidRequestError:
    """The refusal of an input past a cap: what, its count, the limit and the setting that raises it."""
    return InvalidRequestError(f"{what} has {n} {unit}; the limit is {limit} (the setting {setting}, an "
                               f"EngineConfig field and config.pbtxt parameter, raises it)")


def check_token_ids(ids: Any, what: str, vocab_size: int) -> None:
    """Every token id in `ids` (ints or an integer array) is in [0, vocab_size) (vocab_size 0: unknown,
    only >= 0 is checked); else InvalidRequestError naming `what` and the first bad value. One pass.
    The one range check of every client-given id: the Triton stub's parsing (per input, the field's
    name) and the engine's intake (SamplingParams.validate) both call it."""
    if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        a = ids.reshape(-1)
        bad = np.flatnonzero((a < 0) | (a >= vocab_size)) if vocab_size else np.flatnonzero(a < 0)
        first = int(a[bad[0]]) if bad.size else None
    else:
        first = next((t for t in ids if not (0 <= t < vocab_size if vocab_size else t >= 0)), None)
    if first is not None:
        rule = f"in [0, {vocab_size}) (the model's vocabulary)" if vocab_size else ">= 0"
        raise InvalidRequestError(f"{what} token ids must be {rule}: {first} is out of range")


@dataclass(frozen=True)
class ListLimits:
    """Per-request counts of the lists the engine loop scans on every token (stop strings, stop
    token ids, stop word and bad word token sequences): each costs work per generated token, so a
    client may not pick them without bound. Built from EngineConfig (its fields of the same names);
    0 = no cap."""

    max_stop_strings: int = 64  # stop strings (vLLM / OpenAI `stop`)
    max_stop_token_ids: int = 256  # vLLM `stop_token_ids`
    max_stop_words: int = 256  # TensorRT-LLM stop words: `stop_words` and `stop_words_list` together
    max_bad_words: int = 256  # bad words: `bad_words`, `bad_words_list`, vLLM `bad_words`
    max_word_tokens: int = 8192  # token ids in a request's stop words and bad words together

    @classmethod
    def from_config(cls, cfg: Any) -> "ListLimits":
        return cls(cfg.max_stop_strings, cfg.max_stop_token_ids, cfg.max_stop_words, cfg.max_bad_words,
                   cfg.max_word_tokens)

    def check(self, what: str, n: int, unit: str, setting: str) -> None:
        """InvalidRequestError when `n` exceeds the cap named `setting` (one of this class's fields)."""
        limit = getattr(self, setting)
        if limit and n > limit:
            raise limit_exceeded(what, n, unit, limit, setting)


class QueueFullError(RuntimeError):
    """The waiting queue is full (UNAVAILABLE)."""

    code = "UNAVAILABLE"


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (UNAVAILABLE)."""

    code = "UNAVAILABLE"


CLIENT_ERRORS = (InvalidRequestError, QueueFullError, EngineDeadError)  # their messages are written for clients


def task_name(task_id: int) -> str:
    """The adapter name a TensorRT-LLM LoRA task runs under (engine and metrics alike)."""
    return f"task {task_id}"


def error_code(exc: BaseException) -> str:
    """The Triton error code name for an exception: its own for ours, INTERNAL for anything else."""
    return exc.code if isinstance(exc, CLIENT_ERRORS) else "INTERNAL"


@dataclass
class SamplingParams:
    """Per-request decoding parameters. Greedy when temperature == 0 or top_k == 1."""

    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop tokens are suppressed before this many tokens
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off: tokens below min_p x the likeliest token's probability are dropped (vLLM)
    seed: Optional[int] = None  # None = a random seed drawn at submit
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    include_stop_str_in_output: bool = False  # vLLM: the text ends after the stop string instead of before it
    stop_token_ids: list[int] = field(default_factory=list)
    end_id: Optional[int] = None  # None = the tokenizer's EOS tokens
    ignore_eos: bool = False
    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never generated
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF/TRT-LLM)
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output (OpenAI/vLLM)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # added to the logits of these token ids at every position (OpenAI / vLLM `logit_bias`), before
    # the grammar mask and temperature; -100 in effect bans a token, +100 all but forces it
    logit_bias: dict[int, float] = field(default_factory=dict)
    # TRT-LLM stop words: the output ends (finish_reason "stop") once it ends with one of these
    # token sequences (matched in the output only, from min_tokens on); the tokens stay in the output
    stop_token_seqs: list[list[int]] = field(default_factory=list)
    # per-token outputs (computed only for requests that ask; see RequestOutput). Log probs are of
    # the distribution a token is drawn from: logits after penalties, bad-word and min_tokens bans
    # and the grammar mask, / temperature (1 for greedy), top-k/min-p/top-p kept set renormalized (not for
    # greedy). Speculation does not change them (accepted drafts: the target's p at that position)
    return_log_probs: bool = False  # RequestOutput.logprobs
    top_logprobs: int = 0  # RequestOutput.top_logprobs: N <= 20 most likely per position (vLLM `logprobs`); implies logprobs
    return_generation_logits: bool = False  # RequestOutput.generation_logits (raw model logits)
    return_context_logits: bool = False  # RequestOutput.context_logits (raw model logits of the prompt)
    prompt_logprobs: Optional[int] = None  # vLLM: each prompt token's log p under the model (raw) and the top N

    @property
    def wants_logprobs(self) -> bool:
        return self.return_log_probs or self.top_logprobs > 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def normalize(self, vocab_size: int) -> None:
        """vLLM's rules for edge values: a temperature under 1e-5 is greedy, one under 1e-2 is raised
        to 1e-2, a top_k at or past the vocabulary is off."""
        if 0.0 < self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        elif 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.top_k >= vocab_size:
            self.top_k = 0

    def validate(self, max_tokens_limit: int, vocab_size: int = 0, lists: Optional[ListLimits] = None) -> None:
        """InvalidRequestError naming the first bad value. With `vocab_size`, every token id is checked
        against it (else only >= 0); with `lists`, the per-token lists' counts against their caps."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if self.max_tokens > max_tokens_limit:
            raise InvalidRequestError(f"max_tokens {self.max_tokens} exceeds the limit {max_tokens_limit}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be in [0, 2^64), got {self.seed}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not (lo <= self.repetition_penalty <= hi):
            raise InvalidRequestError(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off; outside it the "
                                      f"penalized logits overflow), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (-2.0 <= v <= 2.0):
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        bad = [v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0]
        if bad:
            raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bad[0]}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop words must be non-empty strings")
        if any(not seq for seq in self.bad_words_ids):
            raise InvalidRequestError("bad words must be non-empty")
        if any(not seq for seq in self.stop_token_seqs):
            raise InvalidRequestError("stop token sequences must be non-empty")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        self._check_lists(vocab_size, lists)

    def _check_lists(self, vocab_size: int, lists: Optional[ListLimits]) -> None:
        """The lists scanned on every generated token within their caps (counts first: one pass each),
        then every token id inside the vocabulary."""
        if lists is not None:
            lists.check("stop", len(self.stop), "strings", "max_stop_strings")
            lists.check("stop_token_ids", len(self.stop_token_ids), "ids", "max_stop_token_ids")
            lists.check("the stop words", len(self.stop_token_seqs), "token sequences", "max_stop_words")
            lists.check("the bad words", len(self.bad_words_ids), "token sequences", "max_bad_words")
            n = sum(map(len, self.stop_token_seqs)) + sum(map(len, self.bad_words_ids))
            lists.check("the stop words and bad words", n, "token ids", "max_word_tokens")
        check_token_ids(self.stop_token_ids, "stop_token_ids", vocab_size)
        for word in self.stop_token_seqs:
            check_token_ids(word, "stop words'", vocab_size)
        for word in self.bad_words_ids:
            check_token_ids(word, "bad words'", vocab_size)
        check_token_ids(self.logit_bias, "logit_bias", vocab_size)
        if self.end_id is not None:
            check_token_ids((self.end_id,), "end_id", vocab_size)


class UndeclaredKeys(str, Enum):
    """JSON Schema objects silent on `additionalProperties`: generate only their declared keys
    (FORBID, as xgrammar's strict mode, llama.cpp and OpenAI do) or any key (ALLOW, the spec's
    reading: what MaskBench measures). DEFAULT: the server's `guided_undeclared_keys`."""

    DEFAULT = ""
    FORBID = "forbid"
    ALLOW = "allow"


@dataclass
class GuidedDecodingParams:
    """One guide per request (TensorRT-LLM's GuidedDecodingParams plus vLLM's `choice`)."""

    guide_type: str  # json | json_schema | regex | ebnf_grammar | structural_tag | choice
    guide: str = ""
    backend: str = ""  # "" = the server's guided_backend; auto | xgrammar | llguidance
    strict: bool = False  # OpenAI strict (JSON): additionalProperties false everywhere, all keys required
    any_whitespace: bool = True  # JSON: compact and spaced both allowed (False: compact only)
    whitespace_pattern: str = ""  # JSON: regex for one whitespace run (overrides any_whitespace)
    best_effort: bool = False  # JSON: formats nothing can check are noted, not refused
    any_key_order: bool = False  # JSON: listed keys in any order (llguidance; `required` checked at the close)
    undeclared_keys: UndeclaredKeys = UndeclaredKeys.DEFAULT  # JSON Schema: keys a schema does not declare
    complete_within_budget: bool = True  # JSON: the document closes before max_tokens (guided/budget.py)

    def cache_key(self, backend: str) -> tuple:
        return (backend, self.guide_type, self.guide, self.strict, self.any_whitespace,
                self.whitespace_pattern, self.best_effort, self.any_key_order, UndeclaredKeys(self.undeclared_keys))


@dataclass
class Request:
    """What a client asks for. Either `prompt` (text) or `prompt_ids` must be given."""

    prompt: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    params: SamplingParams = field(default_factory=SamplingParams)
    guided: Optional[GuidedDecodingParams] = None
    num_draft_tokens: Optional[int] = None  # None = the configured K; 0 = no speculation
    request_id: str = ""  # the client's id, echoed in logs
    lora_name: Optional[str] = None  # a LoRA adapter the engine serves (engine/lora_adapters.py); None: the base model
    lora_task_id: Optional[int] = None  # TensorRT-LLM's LoRA cache id, with its weights the first time:
    lora_weights: Optional[np.ndarray] = None  # [n, size] (models/lora.py adapter_from_trtllm)
    lora_config: Optional[np.ndarray] = None  # [n, 3] int32: module id, layer, adapter size
    group: Optional[int] = None  # the client request this is a row of (its batch rows and n share it): slots
    # and decode rows are shared fairly between groups (Scheduler); None: a group of its own
    timeout_s: Optional[float] = None  # None = EngineConfig.request_timeout_s; 0 = no limit
    fault: Optional[str] = None  # injected fault (specguide.engine.faults; honoured only when enabled)


@dataclass
class RequestOutput:
    """One event for one request: the delta since the previous event."""

    seq_id: int
    text: str = ""  # new text since the last event (never half a UTF-8 character)
    token_ids: list[int] = field(default_factory=list)  # new tokens since the last event
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "timeout" | "cancelled" | "error"
    error: Optional[str] = None
    error_code: Optional[str] = None  # with "error": INVALID_ARG (bad guide) | INTERNAL | UNAVAILABLE (engine died)
    stage: Optional[str] = None  # on the final event: queued | compiling | prefill | decode (where it ended)
    guide_notes: tuple[str, ...] = ()  # final event of a JSON guide: keywords its grammar leaves to the value
    # check ("checked when its value closes: uniqueItems at /l") or unenforced (best effort; "not enforced: ...")
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # total so far
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    first_token: bool = False  # this event carries the request's first token(s)
    total_draft_tokens: int = 0  # speculative decoding counters (totals so far)
    total_accepted_draft_tokens: int = 0
    # per-token outputs, aligned with `token_ids` (None unless the request asked)
    logprobs: Optional[list[float]] = None  # log p(token) under the distribution it was drawn from
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None  # per token: top_logprobs (id, log p), best first
    cum_logprob: Optional[float] = None  # sum of the log probs of all output tokens so far (TRT-LLM cum_log_probs)
    generation_logits: Optional[np.ndarray] = None  # [len(token_ids), vocab] float32 raw model logits
    context_logits: Optional[np.ndarray] = None  # [prompt_len, vocab] float32, once (on the first event)
    # with prompt_logprobs, once (on the first event): per prompt token (token id, log p, top N [(id,
    # log p)] best first) under the model's raw distribution; the first token's log p is None (nothing predicts it)
    prompt_logprobs: Optional[list[PromptLogprob]] = None
    # timestamps (time.time_ns(); 0 = not yet) and KV cache figures (TRT-LLM perf metrics), every event
    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    kv_cache_hit_rate: float = 0.0
