"""Issue 75: every token id a client sends is checked at intake (the stub's parsing, with the model's
vocabulary size; the engine's intake again, through the same function), TensorRT-LLM word lists'
offsets are read as TensorRT-LLM reads them, and the lists the engine scans on every token are capped.

The attack: a `bad_words_list` [[[29, 999999], [2, -1]]] past intake would, once a stream wrote 29,
make the step ban token 999999 and fail with an IndexError, ending every stream of that step."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specguide.config import EngineConfig
from specguide.request import InvalidRequestError, ListLimits, Request, SamplingParams, error_code
from specguide.triton.input_limits import InputLimits, model_vocab_size
from specguide.triton.interfaces import INTERFACE_PARAMETER
from specguide.triton.request_parser import parse_request

VOCAB = 49152  # the default model's (its config.json)


class CountingTokenizer:
    """Bytes as tokens (id = byte value); counts its calls."""

    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def s(*vals):
    return np.array([[v.encode() if isinstance(v, str) else v for v in vals]], dtype=np.object_)


def i32(*vals):
    return np.array([list(vals)], np.int32)


def limits(vocab=VOCAB, **settings):
    return InputLimits.from_config(EngineConfig(**{"device": "cpu", "max_seq_len": 2048, **settings}), vocab)


def parse(inputs, tok=None, lim=None, parameters=None):
    return parse_request(inputs, parameters or {}, tokenizer=tok or CountingTokenizer(), max_tokens_limit=2048,
                         limits=lim or limits())


def error(inputs, **kw) -> str:
    with pytest.raises(InvalidRequestError) as e:
        parse(inputs, **kw)
    assert error_code(e.value) == "INVALID_ARG"
    return str(e.value)


def word_list(*words):
    """A [1, 2, L] word list as TensorRT-LLM's preprocessing (`_to_word_list_format`) writes one:
    flat ids padded with 0, cumulative end offsets padded with -1."""
    flat = [t for w in words for t in w]
    ends = list(np.cumsum([len(w) for w in words]))
    pad = max(1, len(flat))
    return np.array([[flat + [0] * (pad - len(flat)), ends + [-1] * (pad - len(ends))]], np.int32)


# ------------------------------------------------------------------ the attack: an id past the vocabulary


def test_the_measured_bad_words_list_is_refused_naming_the_field_and_the_value():
    msg = error({"text_input": s("Hi"), "bad_words_list": np.array([[[29, 999999], [2, -1]]], np.int32)})
    assert "bad_words_list" in msg and "999999" in msg and f"[0, {VOCAB})" in msg


def test_the_engines_intake_refuses_it_too():
    """Defense in depth: a request that reaches the engine without the stub's parsing (the engine's
    own API) is refused at intake, before any step: the same check, through SamplingParams.validate."""
    from specguide.engine.intake import Intake

    intake = Intake(EngineConfig(device="cpu", max_seq_len=2048), None, VOCAB, frozenset({2}), compiler=None)

    def refused(**params) -> str:
        with pytest.raises(InvalidRequestError) as e:
            intake.sequence(Request(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, **params)), print)
        return str(e.value)

    assert "999999" in refused(bad_words_ids=[[29, 999999]])
    assert "-4" in refused(bad_words_ids=[[-4]])
    assert "stop_token_ids" in refused(stop_token_ids=[VOCAB])
    assert "50000" in refused(stop_token_seqs=[[1, 50000]])
    assert "end_id" in refused(end_id=VOCAB + 1)
    assert "logit_bias" in refused(logit_bias={VOCAB: 1.0})
    assert "max_bad_words" in refused(bad_words_ids=[[7]] * 257)
    with pytest.raises(InvalidRequestError, match="input_ids token ids .* 49152 is out of range"):
        intake.sequence(Request(prompt_ids=[1, VOCAB]), print)


def test_logits_past_max_logits_bytes_are_refused_at_intake():
    """A client may not make the engine hold gigabytes of logits (an 8,192-token prompt's context
    logits are 1.6 GB as float32): past max_logits_bytes the request is INVALID_ARG at intake,
    naming the setting; within it, it is taken."""
    from specguide.engine.intake import Intake

    cap = 100 * VOCAB * 4  # 100 rows of logits
    intake = Intake(EngineConfig(device="cpu", max_seq_len=2048, max_logits_bytes=cap), None, VOCAB, frozenset({2}),
                    compiler=None)

    def seq(prompt: int, max_tokens: int, **params):
        return intake.sequence(Request(prompt_ids=[1] * prompt, params=SamplingParams(max_tokens=max_tokens, **params)),
                               print)

    for prompt, max_tokens, params in ((101, 4, dict(return_context_logits=True)),
                                       (3, 101, dict(return_generation_logits=True)),
                                       (60, 41, dict(return_context_logits=True, return_generation_logits=True))):
        with pytest.raises(InvalidRequestError, match="max_logits_bytes") as e:
            seq(prompt, max_tokens, **params)
        assert error_code(e.value) == "INVALID_ARG" and "101 x 49152 logits" in str(e.value)
    assert seq(100, 4, return_context_logits=True).prompt_ids == [1] * 100
    assert seq(60, 40, return_context_logits=True, return_generation_logits=True)
    assert seq(1500, 8, return_context_logits=False)  # no logits asked for: no cap
    assert Intake(EngineConfig(device="cpu", max_seq_len=2048, max_logits_bytes=0), None, VOCAB, frozenset({2}),
                  compiler=None).sequence(Request(prompt_ids=[1] * 1000, params=SamplingParams(
                      max_tokens=4, return_context_logits=True)), print)  # 0: no limit


# ------------------------------------------------------------------ every id, named


@pytest.mark.parametrize("inputs, field, value", [
    ({"text_input": s("Hi"), "bad_words_list": word_list([5], [VOCAB])}, "bad_words_list", VOCAB),
    ({"text_input": s("Hi"), "stop_words_list": word_list([5, 70000])}, "stop_words_list", 70000),
    ({"text_input": s("Hi"), "stop_words_list": word_list([-3])}, "stop_words_list", -3),
    ({"text_input": s("Hi"), "end_id": i32(VOCAB)}, "end_id", VOCAB),
    ({"text_input": s("Hi"), "end_id": i32(-1)}, "end_id", -1),
    ({"text_input": s("Hi"), "pad_id": i32(123456)}, "pad_id", 123456),
    ({"input_ids": i32(1, 2, 60000)}, "input_ids", 60000),
    ({"input_ids": i32(1, -2)}, "input_ids", -2),
    ({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"stop_token_ids": [2, 99999]}))}, "stop_token_ids", 99999),
    ({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"logit_bias": {"49152": 1}}))}, "logit_bias", VOCAB),
    ({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"logit_bias": {"-7": 1}}))}, "logit_bias", -7),
])
def test_an_id_outside_the_vocabulary_is_invalid_arg_naming_the_field_and_the_value(inputs, field, value):
    msg = error(inputs)
    assert msg.startswith(field) and f": {value} is out of range" in msg, msg


def test_ids_tokenized_from_words_are_checked_against_the_models_vocabulary():
    """Words are tokenized by the stub's tokenizer, whose ids may run past the model's vocabulary
    (here: bytes, 'z' = 122, against a 100-token model)."""
    small = limits(vocab=100)
    assert "embedding_bias_words" in error({"text_input": s("a"), "embedding_bias_words": s("z"),
                                            "embedding_bias_weights": np.array([[1.0]], np.float32)}, lim=small)
    assert ": 122 is out of range" in error({"text_input": s("a"), "bad_words": s("z")}, lim=small)
    assert ": 122 is out of range" in error({"text_input": s("a"), "stop_words": s("z")}, lim=small)
    ok = parse({"text_input": s("a"), "bad_words": s("ab")}, lim=small)[0]
    assert ok.request.params.bad_words_ids == [[97, 98]]


def test_the_vllm_interface_checks_its_ids_too():
    vllm = {INTERFACE_PARAMETER: "vllm"}
    msg = error({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"stop_token_ids": [VOCAB]}))},
                parameters=vllm)
    assert msg.startswith("stop_token_ids") and str(VOCAB) in msg


def test_ids_inside_the_vocabulary_pass():
    (p,) = parse({"input_ids": i32(0, 5, VOCAB - 1), "end_id": i32(VOCAB - 1), "pad_id": i32(0),
                  "exclude_input_in_output": np.array([[True]]),
                  "bad_words_list": word_list([29, VOCAB - 1], [2]), "stop_words_list": word_list([7])})
    sp = p.request.params
    assert p.request.prompt_ids == [0, 5, VOCAB - 1] and sp.end_id == VOCAB - 1
    assert sp.bad_words_ids == [[29, VOCAB - 1], [2]] and sp.stop_token_seqs == [[7]]


def test_a_dense_embedding_bias_takes_one_value_per_token_id_of_the_model():
    """TensorRT-LLM refuses an embedding_bias whose length is not the vocabulary size ("The embedding
    bias shape is not as expected"); a longer one would bias ids past the vocabulary. The ensemble sends
    [B, 0] when it has no bias words: no bias."""
    for n in (VOCAB - 1, VOCAB + 1, 300):
        msg = error({"text_input": s("Hi"), "embedding_bias": np.zeros((1, n), np.float32)})
        assert f"embedding_bias has {n} values" in msg and str(VOCAB) in msg
    dense = np.zeros((1, VOCAB), np.float32)
    dense[0, VOCAB - 1] = -5.0
    assert parse({"text_input": s("Hi"), "embedding_bias": dense})[0].request.params.logit_bias == {VOCAB - 1: -5.0}
    assert parse({"text_input": s("Hi"), "embedding_bias": np.zeros((1, 0), np.float32)})[0].request.params.logit_bias == {}


# ------------------------------------------------------------------ word lists' offsets


def test_word_lists_as_tensorrt_llm_clients_send_them_still_work():
    """The preprocessing's format: ids padded with 0, offsets with -1 (a batch pads its rows to the
    longest); an empty list is [[0], [-1]]; the [2, L] form without a batch axis too."""
    rows = np.concatenate([word_list([5, 6], [7]), np.array([[[9, 0, 0], [1, -1, -1]]], np.int32)])
    got = parse({"text_input": s("a", "b").reshape(2, 1), "bad_words_list": rows})
    assert [p.request.params.bad_words_ids for p in got] == [[[5, 6], [7]], [[9]]]
    assert parse({"text_input": s("a"), "stop_words_list": word_list()})[0].request.params.stop_token_seqs == []
    flat = parse({"text_input": s("a"), "stop_words_list": np.array([[3, 4, 5], [2, 3, -1]], np.int32)})
    assert flat[0].request.params.stop_token_seqs == [[3, 4], [5]]


@pytest.mark.parametrize("offsets, message", [
    ([2, 1, -1], "offset 1 after 2 ends no word (offsets increase, from 1)"),
    ([0, 2, -1], "offset 0 after 0 ends no word (offsets increase, from 1)"),
    ([1, 1, 3], "offset 1 after 1 ends no word (offsets increase, from 1)"),
    ([1, 4, -1], "offset 4 is past the end of its 3 token ids"),
    ([-5, 2, -1], "offset -5 is negative (only -1 pads the offsets)"),
    ([1, -1, 3], "offset 3 follows a -1 (offsets are padded with -1 at the end only)"),
])
def test_bad_offsets_are_a_clear_error_not_an_index_error(offsets, message):
    msg = error({"text_input": s("a"), "bad_words_list": np.array([[[5, 6, 7], offsets]], np.int32)})
    assert msg == f"bad_words_list: {message}"


def test_a_word_list_must_be_two_rows_of_integers():
    assert "[2, L]" in error({"text_input": s("a"), "stop_words_list": np.array([[[1, 2, 3]]], np.int32)})
    assert "integers" in error({"text_input": s("a"), "stop_words_list": np.array([[[1.5], [1.0]]], np.float32)})


# ------------------------------------------------------------------ counts capped


def _cap_message(msg, what, n, limit, setting):
    assert msg.startswith(f"{what} has {n} ") and f"the limit is {limit} (the setting {setting}" in msg, msg


def test_stop_strings_are_counted_before_they_are_read():
    stops = ["x"] * 65 + [5]  # the 66th is no string: the count refuses it first
    msg = error({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"stop": stops}))})
    _cap_message(msg, "stop", 66, 64, "max_stop_strings")
    assert parse({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"stop": ["x"] * 64}))})


def test_words_are_counted_before_they_are_tokenized():
    tok = CountingTokenizer()
    msg = error({"text_input": s("Hi"), "bad_words": s(*[f"w{i}" for i in range(257)])}, tok=tok)
    _cap_message(msg, "bad_words", 257, 256, "max_bad_words")
    tok2 = CountingTokenizer()
    msg = error({"text_input": s("Hi"), "stop_words": s(*[f"w{i}" for i in range(5)])}, tok=tok2,
                lim=limits(max_stop_words=4))
    _cap_message(msg, "stop_words", 5, 4, "max_stop_words")
    tok3 = CountingTokenizer()
    msg = error({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"bad_words": ["a", "b", "c"]}))},
                tok=tok3, lim=limits(max_bad_words=2))
    _cap_message(msg, "bad_words", 3, 2, "max_bad_words")
    assert tok.calls == tok2.calls == tok3.calls == 0  # refused before anything was tokenized (the prompt too)


def test_word_lists_are_counted_before_their_words_are_built():
    msg = error({"text_input": s("Hi"), "bad_words_list": word_list(*[[7]] * 300)})
    _cap_message(msg, "bad_words_list", 300, 256, "max_bad_words")
    msg = error({"text_input": s("Hi"), "stop_words_list": word_list([1, 2, 3], [4, 5])}, lim=limits(max_word_tokens=4))
    _cap_message(msg, "stop_words_list", 5, 4, "max_word_tokens")


def test_the_caps_hold_for_the_words_of_all_inputs_together():
    """stop_words and stop_words_list each within max_stop_words, together past it; stop words and
    bad words each within max_word_tokens, together past it."""
    msg = error({"text_input": s("Hi"), "stop_words": s("a", "b"), "stop_words_list": word_list([1], [2])},
                lim=limits(max_stop_words=3))
    _cap_message(msg, "the stop words", 4, 3, "max_stop_words")
    msg = error({"text_input": s("Hi"), "stop_words_list": word_list([1, 2, 3]), "bad_words_list": word_list([4, 5])},
                lim=limits(max_word_tokens=4))
    _cap_message(msg, "the stop words and bad words", 5, 4, "max_word_tokens")


def test_stop_token_ids_are_capped():
    msg = error({"text_input": s("Hi"), "sampling_parameters": s(json.dumps({"stop_token_ids": list(range(257))}))})
    _cap_message(msg, "stop_token_ids", 257, 256, "max_stop_token_ids")


def test_zero_turns_a_cap_off():
    lim = limits(max_stop_strings=0, max_bad_words=0, max_word_tokens=0)
    (p,) = parse({"text_input": s("Hi"), "bad_words_list": word_list(*[[7]] * 300),
                  "sampling_parameters": s(json.dumps({"stop": ["x"] * 100}))}, lim=lim)
    assert len(p.request.params.bad_words_ids) == 300 and len(p.request.params.stop) == 100


def test_the_caps_and_the_vocabulary_come_from_the_settings_and_the_models_config(tmp_path):
    cfg = EngineConfig(device="cpu", max_stop_strings=3, max_stop_token_ids=4, max_stop_words=5, max_bad_words=6,
                       max_word_tokens=7)
    assert InputLimits.from_config(cfg, 123).lists == ListLimits(3, 4, 5, 6, 7)
    assert InputLimits.from_config(cfg, 123).vocab_size == 123
    with pytest.raises(ValueError, match="max_bad_words must be >= 0"):
        EngineConfig(device="cpu", max_bad_words=-1)
    assert EngineConfig.from_parameters({"max_word_tokens": {"string_value": "9"}}).max_word_tokens == 9
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 49152}))
    assert model_vocab_size(tmp_path) == 49152
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {"vocab_size": 262208}}))
    assert model_vocab_size(tmp_path) == 262208  # the text model's, as the engine's loader reads it
    assert model_vocab_size(tmp_path / "missing") == 0 and model_vocab_size("") == 0
