"""TensorRT-LLM's sampling tensors (`temperature`, `top_k`, stop and bad words, penalties, logit
bias, ...) applied to a SamplingParams, with TensorRT-LLM's rules. The vLLM JSON is `vllm_params`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..request import InvalidRequestError, SamplingParams, check_token_ids
from .input_limits import InputLimits
from .values import Row, encode_words
from .vllm_params import PENALTIES


def apply_trtllm_sampling(row: Row, sp: SamplingParams, explicit_sampling: bool, tokenizer: Any,
                          limits: InputLimits) -> None:
    """TensorRT-LLM tensors. Greedy unless temperature, top_k or top_p is given (TRT-LLM's rule);
    `top_k` / `top_p` <= 0 mean unset, as TensorRT-LLM's clients send 0 by default."""
    temperature, top_k, top_p = row.float("temperature"), row.int("top_k"), row.float("top_p")
    top_k = top_k if top_k is not None and top_k > 0 else None
    top_p = top_p if top_p is not None and top_p > 0 else None
    if not explicit_sampling and (temperature is not None or top_k is not None or top_p is not None):
        sp.temperature = 1.0
    if temperature is not None:
        sp.temperature = temperature
    if top_k is not None:
        sp.top_k = top_k
    if top_p is not None:
        sp.top_p = top_p
    max_tokens = row.int("max_tokens")
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    min_tokens = row.int("min_tokens")
    if min_tokens is not None:
        sp.min_tokens = min_tokens
    seed = row.int("seed")
    if seed is not None:
        sp.seed = seed
    vocab, lists = limits.vocab_size, limits.lists
    end_id = row.int("end_id")
    if end_id is not None:
        check_token_ids((end_id,), "end_id", vocab)
        sp.end_id = end_id
    pad_id = row.int("pad_id")  # not used here (no padding), but a token id all the same
    if pad_id is not None:
        check_token_ids((pad_id,), "pad_id", vocab)
    # stop words end the sequence on their token sequences and stay in the output (TensorRT-LLM);
    # strings are counted before they are tokenized, lists before their words are built
    stop = _words(row, "stop_words", tokenizer, lists, "max_stop_words")
    stop += row.word_lists("stop_words_list", lists, "max_stop_words", vocab)
    if stop:
        sp.stop_token_seqs = list(sp.stop_token_seqs) + stop
    bad = _words(row, "bad_words", tokenizer, lists, "max_bad_words")
    bad += row.word_lists("bad_words_list", lists, "max_bad_words", vocab)
    if bad:
        sp.bad_words_ids = list(sp.bad_words_ids) + bad
    for key in PENALTIES:  # checked by SamplingParams.validate; they do not turn sampling on
        v = row.float(key)
        if v is not None:
            setattr(sp, key, v)
    bias = _embedding_bias(row, tokenizer, vocab)
    if bias:
        sp.logit_bias = {**sp.logit_bias, **bias}


def _words(row: Row, name: str, tokenizer: Any, lists: Any, setting: str) -> list[list[int]]:
    """The token ids of each of a STRING tensor's words (stop_words, bad_words), counted first."""
    words = row.strs(name)
    lists.check(name, len(words), "words", setting)
    return encode_words(words, tokenizer)


def _embedding_bias(row: Row, tokenizer: Any, vocab_size: int) -> dict[int, float]:
    """TensorRT-LLM's logit bias as {token id: bias}: the ensemble's words and weights (each of a
    word's token ids gets its weight added, as its preprocessing does) and `tensorrt_llm`'s dense
    `embedding_bias` (its nonzero entries; one value per token id of the model's vocabulary, as
    TensorRT-LLM requires: another length is an error). Clamped to +-100 (the engine's range; past
    it a token is already banned or forced)."""
    bias: dict[int, float] = {}
    words, weights = row.strs("embedding_bias_words"), row.values("embedding_bias_weights")
    weights = [] if weights is None else [float(w) for w in weights.reshape(-1)]
    if len(words) != len(weights):
        raise InvalidRequestError(f"embedding_bias_words has {len(words)} words and embedding_bias_weights "
                                  f"{len(weights)} weights; they go in pairs")
    for word, weight in zip(words, weights):
        ids = encode_words([word], tokenizer)[0] if word else []
        check_token_ids(ids, "embedding_bias_words", vocab_size)
        for t in ids:
            bias[t] = bias.get(t, 0.0) + weight
    dense = row.values("embedding_bias")
    if dense is not None and dense.size:  # the ensemble sends [B, 0] when it has no bias words
        dense = dense.reshape(-1)
        if vocab_size and dense.size != vocab_size:
            raise InvalidRequestError(f"embedding_bias has {dense.size} values; it takes one per token id of the "
                                      f"model's vocabulary: {vocab_size}")
        for t in np.flatnonzero(dense).tolist():
            bias[t] = bias.get(t, 0.0) + float(dense[t])
    if any(not np.isfinite(v) for v in bias.values()):
        raise InvalidRequestError("embedding bias values must be finite numbers")
    return {t: min(max(v, -100.0), 100.0) for t, v in bias.items()}
