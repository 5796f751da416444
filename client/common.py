"""Talking to the specguide model: request inputs, gRPC streaming, HTTP generate / generate_stream.

Needs only numpy and tritonclient (plus transformers for `apply_chat_template`).
"""
from __future__ import annotations

import json
import os
import queue
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

MODEL = "specguide"

# Input name -> (numpy dtype, Triton datatype); shapes are [1, 1] except the list inputs.
INPUT_TYPES: dict[str, tuple[Any, str]] = {
    "text_input": (np.object_, "BYTES"),
    "input_ids": (np.int32, "INT32"),
    "input_lengths": (np.int32, "INT32"),
    "max_tokens": (np.int32, "INT32"),
    "min_tokens": (np.int32, "INT32"),
    "min_length": (np.int32, "INT32"),
    "stream": (np.bool_, "BOOL"),
    "exclude_input_in_output": (np.bool_, "BOOL"),
    "temperature": (np.float32, "FP32"),
    "top_k": (np.int32, "INT32"),
    "top_p": (np.float32, "FP32"),
    "seed": (np.uint64, "UINT64"),
    "random_seed": (np.uint64, "UINT64"),
    "stop_words": (np.object_, "BYTES"),
    "bad_words": (np.object_, "BYTES"),
    "embedding_bias_words": (np.object_, "BYTES"),
    "embedding_bias_weights": (np.float32, "FP32"),
    "end_id": (np.int32, "INT32"),
    "pad_id": (np.int32, "INT32"),
    "num_draft_tokens": (np.int32, "INT32"),
    "guided_decoding_guide_type": (np.object_, "BYTES"),
    "guided_decoding_guide": (np.object_, "BYTES"),
    "sampling_parameters": (np.object_, "BYTES"),
    "return_num_input_tokens": (np.bool_, "BOOL"),
    "return_num_output_tokens": (np.bool_, "BOOL"),
    "return_perf_metrics": (np.bool_, "BOOL"),
    "beam_width": (np.int32, "INT32"),
    "frequency_penalty": (np.float32, "FP32"),
    "presence_penalty": (np.float32, "FP32"),
    "repetition_penalty": (np.float32, "FP32"),
    "length_penalty": (np.float32, "FP32"),
    "timeout_s": (np.float32, "FP32"),
    # the `tensorrt_llm` model's spellings and the rest of the TensorRT-LLM interface
    "request_output_len": (np.int32, "INT32"),
    "streaming": (np.bool_, "BOOL"),
    "runtime_top_k": (np.int32, "INT32"),
    "runtime_top_p": (np.float32, "FP32"),
    "len_penalty": (np.float32, "FP32"),
    "stop_words_list": (np.int32, "INT32"),
    "bad_words_list": (np.int32, "INT32"),
    "embedding_bias": (np.float32, "FP32"),
    "lora_task_id": (np.uint64, "UINT64"),
    "lora_weights": (np.float16, "FP16"),  # [n, size] a request (docs/lora.md)
    "lora_config": (np.int32, "INT32"),  # [n, 3]
    "specguide_lora": (np.object_, "BYTES"),  # a LoRA control request's JSON (docs/lora.md)
    "num_return_sequences": (np.int32, "INT32"),
    "return_log_probs": (np.bool_, "BOOL"),
    "return_logprobs": (np.bool_, "BOOL"),
    "return_context_logits": (np.bool_, "BOOL"),
    "return_generation_logits": (np.bool_, "BOOL"),
    "stop": (np.bool_, "BOOL"),
}
LIST_INPUTS = ("input_ids", "stop_words", "bad_words")


def to_array(name: str, value: Any) -> np.ndarray:
    """One request row as a [1, n] array of the input's dtype (strings are UTF-8 encoded)."""
    dtype, _ = INPUT_TYPES[name]
    values = list(value) if name in LIST_INPUTS else [value]
    if dtype is np.object_:
        values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return np.array([values], dtype=dtype)


def grpc_inputs(values: dict[str, Any]) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in values.items():
        if value is None:
            continue
        arr = to_array(name, value)
        t = grpcclient.InferInput(name, list(arr.shape), INPUT_TYPES[name][1])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


@dataclass
class Chunk:
    """One response: its text delta, token ids, arrival time; or an error."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    t: float = 0.0
    final: bool = False
    finish_reason: str = ""
    batch_index: int = 0
    num_input_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None
    perf: dict[str, float] = field(default_factory=dict)
    error: Optional[str] = None


def _chunk_from_result(result: Any, t: float) -> Chunk:
    resp = result.get_response()
    final = bool(resp.parameters["triton_final_response"].bool_param) if "triton_final_response" in resp.parameters else False
    names = {o.name for o in resp.outputs}
    c = Chunk(t=t, final=final)
    if "text_output" in names:
        c.text = b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8", errors="replace")
    if "output_ids" in names:
        c.token_ids = [int(x) for x in result.as_numpy("output_ids").reshape(-1)]
    if "finish_reason" in names:
        c.finish_reason = result.as_numpy("finish_reason").reshape(-1)[0].decode()
    if "batch_index" in names:
        c.batch_index = int(result.as_numpy("batch_index").reshape(-1)[0])
    if "num_input_tokens" in names:
        c.num_input_tokens = int(result.as_numpy("num_input_tokens").reshape(-1)[0])
    if "num_output_tokens" in names:
        c.num_output_tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
    for k in ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate"):
        if k in names:
            c.perf[k] = float(result.as_numpy(k).reshape(-1)[0])
    return c


class GrpcStream:
    """One gRPC bidirectional stream; `generate()` yields a request's responses as they arrive.

    Requests on one stream run one after the other here; open one GrpcStream per concurrent user.
    """

    def __init__(self, url: str = "localhost:8001", model: str = MODEL):
        import tritonclient.grpc as grpcclient

        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._q: "queue.Queue[tuple[Any, Any, float]]" = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._q.put((result, error, time.perf_counter())))
        self._n = 0

    def generate(self, values: dict[str, Any], timeout: float = 300.0, request_id: str = "") -> Iterator[Chunk]:
        self._n += 1
        self.client.async_stream_infer(
            self.model, grpc_inputs(values), request_id=request_id or f"r{self._n}", enable_empty_final_response=True
        )
        while True:
            result, error, t = self._q.get(timeout=timeout)
            if error is not None:
                yield Chunk(t=t, final=True, error=str(error))
                return
            c = _chunk_from_result(result, t)
            yield c
            if c.final:
                return

    def cancel(self) -> None:
        """Cancel every request in flight on this stream (the stream closes)."""
        self.client.stop_stream(cancel_requests=True)

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _http_body(values: dict[str, Any]) -> bytes:
    body = {}
    for name, value in values.items():
        if value is None:
            continue
        dtype = INPUT_TYPES[name][0]
        if name in LIST_INPUTS:
            body[name] = list(value)
        elif dtype is np.bool_:
            body[name] = bool(value)
        elif dtype in (np.float32,):
            body[name] = float(value)
        elif dtype is np.object_:
            body[name] = value
        else:
            body[name] = int(value)
    return json.dumps(body).encode()


def _chunk_from_json(d: dict, t: float, final: bool) -> Chunk:
    if "error" in d:
        return Chunk(t=t, final=True, error=d["error"])

    def first(v):
        return v[0] if isinstance(v, list) else v

    ids = d.get("output_ids", [])
    c = Chunk(
        text=first(d.get("text_output", "")) or "",
        token_ids=ids if isinstance(ids, list) else [ids],
        t=t,
        final=final,
        finish_reason=first(d.get("finish_reason", "")) or "",
        batch_index=int(first(d.get("batch_index", 0)) or 0),
    )
    if "num_input_tokens" in d:
        c.num_input_tokens = int(first(d["num_input_tokens"]))
    if "num_output_tokens" in d:
        c.num_output_tokens = int(first(d["num_output_tokens"]))
    return c


def _error_body(e: "urllib.error.HTTPError") -> dict:
    """An HTTP error's JSON body ({"error": ...}); generate_stream sends it as one SSE event."""
    raw = (e.read() or b"").decode("utf-8", errors="replace").strip()
    if raw.startswith("data:"):
        raw = raw[len("data:"):].strip()
    try:
        d = json.loads(raw)
    except ValueError:
        d = None
    return d if isinstance(d, dict) and "error" in d else {"error": f"HTTP {e.code}: {raw or e.reason}"}


def http_generate(values: dict[str, Any], url: str = "localhost:8000", model: str = MODEL, timeout: float = 300.0) -> Chunk:
    """POST /v2/models/<model>/generate: exactly one response."""
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=_http_body(values),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _chunk_from_json(json.loads(r.read()), time.perf_counter(), True)
    except urllib.error.HTTPError as e:
        return _chunk_from_json(_error_body(e), time.perf_counter(), True)


def http_generate_stream(values: dict[str, Any], url: str = "localhost:8000", model: str = MODEL,
                         timeout: float = 300.0) -> Iterator[Chunk]:
    """POST /v2/models/<model>/generate_stream: one server-sent event per response.

    SSE carries no final flag; a chunk with a finish_reason (or an error) is the last one.
    """
    values = {**values, "stream": values.get("stream", True)}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream", data=_http_body(values),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    try:
        r = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        yield _chunk_from_json(_error_body(e), time.perf_counter(), True)
        return
    with r:
        for raw in r:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            d = json.loads(line[len("data:"):])
            c = _chunk_from_json(d, time.perf_counter(), False)
            c.final = c.error is not None or bool(c.finish_reason)
            yield c


def default_tokenizer_dir() -> Path:
    base = Path(os.environ.get("SPECGUIDE_CACHE_DIR", Path.home() / ".cache" / "specguide"))
    return base / "models" / "smollm2-135m-instruct"


def load_tokenizer(path: Optional[str] = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or default_tokenizer_dir()))


class ChatTemplate:
    """A model folder's chat template, rendered as transformers renders it (jinja2 sandbox,
    trim_blocks / lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, the special
    tokens' strings) without importing transformers: `--chat` costs ~0.1 s instead of ~4 s."""

    def __init__(self, folder: Path):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text() if jinja.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{folder} has no chat template")
        self.template = template
        self.special = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
                        if k.endswith("_token") and isinstance(v, (str, dict))}

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        assert not tokenize, "a ChatTemplate renders text only"
        from datetime import datetime

        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                    **self.special, **extra)


def load_chat_template(path: Optional[str] = None) -> Any:
    """What `chat_prompt` needs of a model folder: its ChatTemplate (fast), else its tokenizer."""
    folder = Path(path or default_tokenizer_dir())
    try:
        return ChatTemplate(folder)
    except (OSError, ValueError):
        return load_tokenizer(str(folder))


def chat_prompt(tokenizer: Any, user: str, system: Optional[str] = None) -> str:
    """The model's chat template applied to one user turn, ready for generation."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
