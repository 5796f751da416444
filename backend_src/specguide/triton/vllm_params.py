"""The vLLM backend's `sampling_parameters` JSON, read with vLLM's defaults and key names."""
from __future__ import annotations

from typing import Any, Optional

from ..request import InvalidRequestError, ListLimits, SamplingParams, check_token_ids
from .values import as_bool, as_float, as_int, as_list, as_str, check_neutral, encode_words, json_type

VLLM_DEFAULT_MAX_TOKENS = 16
VLLM_MAX_LOGPROBS = 20

# Sampling penalties: the TensorRT-LLM tensors and the vLLM keys have the same names.
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")

# vLLM SamplingParams fields we accept only at their neutral value, and fields we ignore.
_VLLM_NEUTRAL = {
    "n": 1, "best_of": 1, "use_beam_search": False, "length_penalty": 1.0,
}
_VLLM_INTS = ("max_tokens", "min_tokens", "top_k", "seed", "prompt_logprobs")
_VLLM_FLOATS = ("temperature", "top_p", "min_p") + PENALTIES
# accepted and without effect here: output formatting vLLM does its own way, the structured-output
# backend options (read by guided.params), the LoRA adapter's name (read by request_parser)
_VLLM_IGNORED = ("detokenize", "skip_special_tokens", "spaces_between_special_tokens", "output_kind",
                 "truncate_prompt_tokens", "lora_name", "logprobs", "structured_outputs", "guided_decoding",
                 "max_completion_tokens", "stop", "stop_token_ids", "ignore_eos", "bad_words", "early_stopping",
                 "extra_args")
VLLM_SAMPLING_KEYS = frozenset(_VLLM_INTS + _VLLM_FLOATS + tuple(_VLLM_NEUTRAL) + _VLLM_IGNORED
                               + ("logit_bias", "include_stop_str_in_output"))


def logit_bias(value: Any, vocab_size: int = 0) -> dict[int, float]:
    """vLLM's / OpenAI's `logit_bias`: {token id (an integer, or its decimal string as JSON keys are): bias}."""
    if not isinstance(value, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id: bias, got {json_type(value)}")
    out = {}
    for k, v in value.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers), got {k!r}") from None
        bias = as_float(v, "logit_bias")
        if bias is None:
            raise InvalidRequestError(f"logit_bias values must be numbers, got null for {k!r}")
        out[token] = bias
    check_token_ids(out, "logit_bias", vocab_size)
    return out


def sampling_from_vllm(d: dict[str, Any], tokenizer: Any, vocab_size: int = 0,
                       lists: Optional[ListLimits] = None) -> SamplingParams:
    """The vLLM backend's `sampling_parameters`, with vLLM's defaults (max_tokens 16, temperature 1.0).

    Values may be strings ("max_tokens": "16"), as genai-perf sends them. A key vLLM does not know
    is an error naming it. The guide (`structured_outputs` / `guided_decoding`) is read by
    guided.params.resolve_guided. Token ids are checked against `vocab_size` (0: only >= 0), and
    the lists' lengths against `lists` (None: not here), before their entries are read.
    """
    lists = lists or ListLimits(0, 0, 0, 0, 0)
    unknown = [k for k in d if k not in VLLM_SAMPLING_KEYS]
    if unknown:
        raise InvalidRequestError(f"sampling_parameters: unknown key '{unknown[0]}'")
    sp = SamplingParams(max_tokens=VLLM_DEFAULT_MAX_TOKENS, temperature=1.0)
    for key in _VLLM_INTS:
        if d.get(key) is not None:
            setattr(sp, key, as_int(d[key], key))
    for key in _VLLM_FLOATS:
        if d.get(key) is not None:
            setattr(sp, key, as_float(d[key], key))
    if sp.top_k == -1:  # vLLM's "off"
        sp.top_k = 0
    if d.get("max_tokens") is None and d.get("max_completion_tokens") is not None:
        sp.max_tokens = as_int(d["max_completion_tokens"], "max_completion_tokens")
    stop = d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            sp.stop = [stop] if stop else []
        elif isinstance(stop, list):
            lists.check("stop", len(stop), "strings", "max_stop_strings")
            sp.stop = [as_str(s, "each stop string") for s in stop if s != ""]
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {json_type(stop)}")
    if d.get("stop_token_ids") is not None:
        ids = as_list(d["stop_token_ids"], "stop_token_ids")
        lists.check("stop_token_ids", len(ids), "ids", "max_stop_token_ids")
        ids = [as_int(t, "each stop_token_ids entry") for t in ids]
        check_token_ids(ids, "stop_token_ids", vocab_size)
        sp.stop_token_ids = ids
    if d.get("ignore_eos") is not None:
        sp.ignore_eos = bool(as_bool(d["ignore_eos"], "ignore_eos"))
    if d.get("include_stop_str_in_output") is not None:
        sp.include_stop_str_in_output = bool(as_bool(d["include_stop_str_in_output"], "include_stop_str_in_output"))
    if d.get("bad_words") is not None:
        words = [d["bad_words"]] if isinstance(d["bad_words"], str) else as_list(d["bad_words"], "bad_words")
        lists.check("bad_words", len(words), "words", "max_bad_words")  # before any is tokenized
        sp.bad_words_ids = encode_words([as_str(w, "each bad_words entry") for w in words], tokenizer)
    if d.get("logit_bias") is not None:
        sp.logit_bias = logit_bias(d["logit_bias"], vocab_size)
    for key, neutral in _VLLM_NEUTRAL.items():
        v = d.get(key)
        if v is not None:
            check_neutral(key, as_bool(v, key) if isinstance(neutral, bool) else as_float(v, key), neutral)
    return sp
