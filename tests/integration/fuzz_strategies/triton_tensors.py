"""Raw tensors for the three served names over gRPC (`triton_case`): the declared inputs of each
interface (`specguide.triton.interfaces`) and unknown ones; the declared dtype mostly, a wrong one
sometimes; [B, 1] shapes and wrong ones; each input's values sane (`sane_row`) or hostile
(`row_values`)."""
from __future__ import annotations

import json
import math
from typing import Any, Optional

import numpy as np
from hypothesis import strategies as st

from specguide.triton.interfaces import INTERFACES, Spec

from .case import GUIDE_TYPES, MAX_SEQ_LEN, PROMPT_BYTES_CAP, VLLM, VOCAB, Case
from .guides import guides
from .primitives import COMMON_IDS, OUT_OF_VOCAB, floats32, ints32, lengths, small_counts, texts, token_ids, uint64s
from .sampling import SANE_IDS, SANE_WORDS, VLLM_KEYS, sampling_parameters, vllm_sane

NP = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64,
      "TYPE_BOOL": np.bool_, "TYPE_FP16": np.float16}
WRONG_DTYPES = [np.object_, np.int32, np.int64, np.float32, np.float64, np.float16, np.bool_, np.uint64, np.int8,
                np.uint8, np.uint32, np.int16]
UNKNOWN_NAMES = ["foo", "TEXT_INPUT", "text_input ", "prompt", "lora_path", "prompt_embedding_table",
                 "draft_input_ids", "x" * 200, "max_tokens\x00", "image", "embedding_request", "return_finish_reason",
                 "input_ids", "sampling_parameters", "text_output", "specguide_error"]
# names whose values mean something (drawn with care); the rest by their declared dtype
LENGTH_NAMES = {"max_tokens", "request_output_len"}


def _array(values: list, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """`values` cycled into an array of `shape` and `dtype` (wrapped, as C would, when out of range)."""
    n = int(np.prod(shape)) if shape else 1
    vals = (values * (n // max(len(values), 1) + 1))[:n] if values else []
    if dtype is np.object_:
        conv = [v if isinstance(v, bytes) else str(v).encode() for v in vals]
        return np.array(conv + [b""] * (n - len(conv)), dtype=np.object_).reshape(shape)
    with np.errstate(all="ignore"):
        out = []
        for v in vals:
            if isinstance(v, bytes):
                v = len(v)
            if np.issubdtype(dtype, np.integer) and isinstance(v, float):
                v = 0 if not math.isfinite(v) else int(max(min(v, 2**63 - 1), -(2**63)))
            if np.issubdtype(dtype, np.integer):
                info = np.iinfo(dtype)
                v = (int(v) - info.min) % (info.max - info.min + 1) + info.min  # wrap
            out.append(v)
        arr = np.array(out + [0] * (n - len(out)), dtype=np.float64 if np.issubdtype(dtype, np.floating) else object)
        return arr.astype(dtype).reshape(shape)


SANE_PROMPTS = [b"The capital of France is", b"Hi", b"Write a haiku about the sea.", b"1, 2, 3,",
                "\u00bfD\u00f3nde est\u00e1 la playa?".encode(), b"<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"]


def _word_list(words: list[list[int]]) -> list:
    ids = [i for w in words for i in w]
    offsets, end = [], 0
    for w in words:
        end += len(w)
        offsets.append(end)
    width = max(len(ids), 1)
    return [(ids + [0] * width)[:width], (offsets + [-1] * width)[:width]]


@st.composite
def sane_row(draw, name: str, spec: Spec) -> list:
    """One row's values for input `name` that the server accepts (cheap: at most 8 tokens)."""
    if name in LENGTH_NAMES:
        return [draw(st.integers(1, 8))]
    if name in ("min_tokens", "min_length"):
        return [draw(st.integers(0, 4))]
    if name == "text_input":
        return [draw(st.sampled_from(SANE_PROMPTS))]
    if name == "input_ids":
        return draw(SANE_IDS)
    if name == "input_lengths":
        return [1]
    if name == "num_return_sequences":
        return [draw(st.integers(1, 3))]
    if name == "num_draft_tokens":
        return [draw(st.integers(0, 4))]
    if name == "beam_width":
        return [1]
    if name in ("end_id", "pad_id"):
        return [draw(st.integers(0, VOCAB - 1))]
    if name in ("stop_words_list", "bad_words_list"):
        return _word_list(draw(st.lists(SANE_IDS, min_size=1, max_size=3)))
    if name == "lora_task_id":
        return [draw(st.integers(1, 3))]
    if name == "lora_weights":
        return [[0.0] * 8]
    if name == "lora_config":
        return [[draw(st.integers(0, 7)), draw(st.integers(0, 29)), 1]]
    if name == "specguide_lora":  # LoRA control requests (none can load: no folder under the root)
        return [json.dumps(draw(st.sampled_from([
            {"action": "list"}, {"action": "unload", "lora_name": "fuzz"},
            {"action": "load", "lora_name": "fuzz", "lora_path": "/etc"},
            {"action": "load", "lora_name": "fuzz", "lora_path": "../../x"}]))).encode()]
    if name == "embedding_bias":
        i, w = draw(st.integers(0, VOCAB - 1)), draw(st.floats(-100, 100, width=32))
        return [w if j == i else 0.0 for j in range(VOCAB)]
    if name in ("stop_words", "bad_words", "embedding_bias_words"):
        return [w.encode() for w in draw(SANE_WORDS)] or [b"."]
    if name == "embedding_bias_weights":
        return [draw(st.floats(-100, 100, width=32))]
    if name == "guided_decoding_guide_type":
        return [draw(st.sampled_from(GUIDE_TYPES)).encode()]
    if name == "guided_decoding_guide":
        return [draw(guides(hostile=False))[1].encode()]
    if name == "sampling_parameters":
        keys = draw(st.lists(st.sampled_from(VLLM_KEYS), max_size=4, unique=True))
        d = {k: draw(vllm_sane(k)) for k in keys}
        d.setdefault("max_tokens", draw(st.integers(1, 8)))
        return [json.dumps(d).encode()]
    if name in ("temperature", "top_p", "runtime_top_p"):
        return [draw(st.floats(0.0, 1.5, width=32))]
    if name in ("frequency_penalty", "presence_penalty"):
        return [draw(st.floats(-2.0, 2.0, width=32))]
    if name == "repetition_penalty":
        return [draw(st.floats(0.5, 2.0, width=32))]
    if name in ("top_k", "runtime_top_k"):
        return [draw(st.integers(0, 50))]
    if name == "timeout_s":
        return [draw(st.floats(0.0, 60.0, width=32))]
    if name == "stop":
        return [False]
    return draw(row_values(name, spec))


@st.composite
def row_values(draw, name: str, spec: Spec) -> list:
    """One row's values for input `name` in its declared dtype (a list: [1] dims give one value),
    hostile: extremes, odd lengths, bad guides and JSON."""
    dt = spec.dtype
    if name in LENGTH_NAMES:
        return [draw(lengths)]
    if name in ("min_tokens", "min_length"):
        return [draw(st.one_of(st.integers(0, 8), ints32))]
    if name == "text_input":
        return [draw(texts(PROMPT_BYTES_CAP))]
    if name == "input_ids":
        n = draw(st.one_of(st.integers(0, 8), st.sampled_from([MAX_SEQ_LEN - 1, MAX_SEQ_LEN, 5000])))
        if n > 8:
            return [draw(token_ids)] * n
        return draw(st.lists(token_ids, min_size=n, max_size=n))
    if name in ("input_lengths", "num_return_sequences", "num_draft_tokens", "beam_width"):
        return [draw(small_counts)]
    if name in ("end_id", "pad_id"):
        return [draw(token_ids)]
    if name == "lora_weights":  # rows of any length, extremes and NaN among them
        n = draw(st.sampled_from([0, 1, 3, 240]))
        width = draw(st.sampled_from([0, 1, 7] if n > 3 else [0, 1, 7, 1536, 20000]))
        return [[draw(st.sampled_from([0.0, 1.0, -65504.0, float("nan"), float("inf")]))] * width for _ in range(n)]
    if name == "lora_config":
        n = draw(st.sampled_from([0, 1, 3, 240]))
        return [[draw(st.one_of(st.integers(-1, 17), ints32)) for _ in range(3)] for _ in range(n)]
    if name in ("stop_words_list", "bad_words_list"):
        if draw(st.integers(0, 3)) == 0:  # a common token, then one out of the vocabulary (issue 75)
            return _word_list([[draw(st.sampled_from(COMMON_IDS)), draw(st.sampled_from(OUT_OF_VOCAB))]])
        ids = draw(st.lists(token_ids, min_size=0, max_size=6))
        offsets = draw(st.one_of(st.just(list(range(1, len(ids) + 1))), st.lists(st.one_of(st.integers(-2, 8), ints32),
                                                                                  max_size=6)))
        width = max(len(ids), len(offsets), 1)
        return [(ids + [-1] * width)[:width], (offsets + [-1] * width)[:width]]  # [2, width]
    if name == "embedding_bias":
        n = draw(st.sampled_from([0, 1, 5, VOCAB, VOCAB + 1, 300]))
        vals = draw(st.lists(floats32, min_size=1, max_size=4))
        return [vals[i % len(vals)] if i % 97 == 0 else 0.0 for i in range(n)] if n else []
    if name in ("stop_words", "bad_words", "embedding_bias_words", "image"):
        many = draw(st.sampled_from([0, 1, 3, 1000]))
        if many == 1000:
            return [b"w%d" % i for i in range(many)]
        return draw(st.lists(texts(2048), min_size=many, max_size=many))
    if name == "embedding_bias_weights":
        return draw(st.lists(floats32, max_size=4))
    if name == "guided_decoding_guide_type":
        return [draw(st.sampled_from(GUIDE_TYPES + ("", "JSON", "lark", "x" * 100))).encode()]
    if name == "guided_decoding_guide":
        return [draw(guides())[1].encode("utf-8", "surrogatepass")]
    if name == "sampling_parameters":
        return [draw(sampling_parameters())]
    if name == "stop":
        return [draw(st.booleans())]
    if dt == "TYPE_BOOL":
        return [draw(st.booleans())]
    if dt == "TYPE_FP32":
        return [draw(floats32)]
    if dt == "TYPE_INT32":
        return [draw(ints32)]
    if dt == "TYPE_UINT64":
        return [draw(uint64s)]
    return [draw(texts(256))]


def _row_shape(spec: Spec, row: list, name: str) -> tuple[int, ...]:
    if name in ("stop_words_list", "bad_words_list"):
        return (2, len(row[0]))
    if name in ("lora_weights", "lora_config"):
        return (len(row), len(row[0]) if row else (3 if name == "lora_config" else 0))
    if spec.dims == (1,):
        return (1,)
    return (len(row),)


@st.composite
def tensor(draw, name: str, spec: Spec, batch: Optional[int]) -> np.ndarray:
    """One input tensor: mostly the declared dtype and shape with drawn values; sometimes a wrong dtype
    or a wrong shape. `batch` None: a max_batch_size 0 model (no batch dimension). Values are sane
    (two thirds) or hostile."""
    row = draw(st.one_of(sane_row(name, spec), sane_row(name, spec), row_values(name, spec)))
    if name in ("stop_words_list", "bad_words_list", "lora_weights", "lora_config"):
        flat = [v for part in row for v in part]
    else:
        flat = row
    shape = _row_shape(spec, row, name)
    full = shape if batch is None else (batch, *shape)
    dtype = NP[spec.dtype]
    mutation = draw(st.sampled_from(["none"] * 18 + ["dtype", "shape"]))
    if mutation == "dtype":
        dtype = draw(st.sampled_from([d for d in WRONG_DTYPES if d is not NP[spec.dtype]]))
    elif mutation == "shape":
        full = draw(st.sampled_from([(1, 0), (0, 1), (0,), (1,), (1, 1, 1), (2, 1), (1, 2), (1, 3), (65, 1), (3,),
                                     (1, 1, 0), (2, 2, 2)]))
    return _array(flat, dtype, tuple(full))


@st.composite
def triton_case(draw, model: str) -> Case:
    """Raw tensors for one of the three served names."""
    iface = INTERFACES[model]
    specs = {s.name: s for s in iface.inputs}
    batch: Optional[int] = None
    if iface.max_batch_size:
        batch = draw(st.sampled_from([1] * 24 + [2, 2, 3, 3, 64, 65]))
    names: list[str] = []
    prompt = "text_input" if model == VLLM else draw(st.sampled_from(["text_input"] * 4 + ["input_ids", "both", "none"]))
    if prompt == "both":
        names += ["text_input", "input_ids"]
    elif prompt != "none":
        names.append(prompt)
    if model != VLLM and draw(st.integers(0, 9)):
        names.append(draw(st.sampled_from(sorted(LENGTH_NAMES))))
    names += draw(st.lists(st.sampled_from(sorted(specs)), max_size=5, unique=True))
    if model == VLLM and "sampling_parameters" not in names and draw(st.integers(0, 3)):
        names.append("sampling_parameters")
    guide_names = ("guided_decoding_guide_type", "guided_decoding_guide")
    if model != VLLM and draw(st.integers(0, 2)) == 0:  # a guide in a third of the requests
        names += list(guide_names)
    paired = model != VLLM and any(n in names for n in guide_names) and draw(st.integers(0, 5)) > 0
    out: dict[str, np.ndarray] = {}
    if paired:  # a type and its guide, sane or hostile, as a client sends them
        gtype, text = draw(guides())
        for n, v in zip(guide_names, (gtype, text)):
            out[n] = _array([v.encode("utf-8", "surrogatepass")], np.object_, (batch or 1, 1))
        names = [n for n in names if n not in guide_names]
    for name in dict.fromkeys(names):
        if name not in specs:
            continue
        b = batch
        if b is not None and b > 3 and name in ("text_input", "input_ids"):
            # many rows are cheap only with short prompts
            out[name] = (_array([draw(texts(64, long=False))], np.object_, (b, 1)) if name == "text_input"
                         else _array(draw(st.lists(token_ids, min_size=1, max_size=8)), np.int32, (b, 8)))
            continue
        out[name] = draw(tensor(name, specs[name], b))
    for name in draw(st.lists(st.sampled_from(UNKNOWN_NAMES), max_size=2, unique=True)) if draw(st.integers(0, 15)) == 0 else []:
        spec = specs.get(name) or Spec(name, "TYPE_INT32", (1,), "", "")
        out[name] = draw(tensor(name, spec, batch))
    if model != VLLM and not any(n in out for n in LENGTH_NAMES) and "sampling_parameters" not in out \
            and draw(st.integers(0, 5)):
        out["max_tokens"] = _array([draw(st.integers(1, 8))], np.int32, (batch or 1, 1))
    rid = draw(st.sampled_from(["", "", "", "fuzz", "1", "x" * 300, "\u00e9", "victim-no"]))
    return Case(model, out, request_id=rid)
