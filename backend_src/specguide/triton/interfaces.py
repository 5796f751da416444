"""The one declaration of the served interfaces: every model name, its tensors, and its config.pbtxt.

Three names share one engine (one copy of the weights, one in-flight batch):

- `specguide`: the TensorRT-LLM interface, decoupled. The ensemble's names and the `tensorrt_llm`
  model's names (`request_output_len`, `streaming`, `runtime_top_k`, ...; two spellings of one
  setting in one request are an error), plus ours (`num_draft_tokens`, `sampling_parameters`, ...).
  It hosts the engine. It also declares the vLLM-only tensors so that `specguide_vllm` can pass
  them on; `request_inputs` refuses them unless the request came through that name.
- `specguide_unary`: the same tensors, not decoupled: one response per request (`ModelInfer`,
  `client.infer()`, HTTP `/infer`).
- `specguide_vllm`: the vLLM backend's auto-completed config exactly (`max_batch_size: 0`, `[1]`
  inputs, its `return_*` flags and outputs).

The last two are thin BLS proxies (`specguide.triton.proxy`) in front of `specguide`.
`python -m specguide.triton.interfaces [--check]` writes (or checks) every config.pbtxt from here;
in `specguide/config.pbtxt` only the engine settings below ENGINE_SETTINGS_MARKER are kept by hand.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ENGINE_MODEL = "specguide"
ENGINE_SETTINGS_MARKER = "# ---- engine settings: hand-edited; everything above is generated ----"


@dataclass(frozen=True)
class Spec:
    """One tensor: Triton dtype, dims (without the batch dimension), documented default."""

    name: str
    dtype: str  # e.g. "TYPE_INT32"
    dims: tuple[int, ...]
    default: str  # documented default ("" for outputs)
    doc: str
    alias_of: Optional[str] = None  # another spelling of this input (TensorRT-LLM's core model)
    vllm_only: bool = False  # declared on `specguide` only to be passed on by `specguide_vllm`


@dataclass(frozen=True)
class Interface:
    """A served model name: its tensors and how Triton runs it."""

    name: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    decoupled: bool
    max_batch_size: int
    kind: str  # "engine" (hosts the engine) | "unary" | "vllm" (BLS proxies to ENGINE_MODEL)
    required: tuple[str, ...] = ()  # inputs that are not optional
    doc: str = ""

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.outputs)


def _s(name, dtype, dims, default, doc, **kw) -> Spec:
    return Spec(name, "TYPE_" + dtype, tuple(dims), default, doc, **kw)


# ------------------------------------------------------------------------------ TensorRT-LLM

TRTLLM_INPUTS: tuple[Spec, ...] = (
    _s("text_input", "STRING", [1], "-", "prompt text (give this or `input_ids`)"),
    _s("input_ids", "INT32", [-1], "-", "prompt token ids (give this or `text_input`)"),
    _s("input_lengths", "INT32", [1], "row length", "valid length of a padded `input_ids` row"),
    _s("max_tokens", "INT32", [1], "`default_max_tokens` (64)", "tokens to generate at most"),
    _s("request_output_len", "INT32", [1], "-", "`tensorrt_llm` spelling of `max_tokens`", alias_of="max_tokens"),
    _s("min_tokens", "INT32", [1], "0", "EOS and stop tokens are suppressed before this many"),
    _s("min_length", "INT32", [1], "0", "TensorRT-LLM spelling of `min_tokens`", alias_of="min_tokens"),
    _s("stream", "BOOL", [1], "false", "one response per step (deltas) instead of one at the end"),
    _s("streaming", "BOOL", [1], "-", "`tensorrt_llm` spelling of `stream`", alias_of="stream"),
    _s("exclude_input_in_output", "BOOL", [1], "false",
       "leave the prompt out of `text_output` / `output_ids` (a stream never repeats the prompt)"),
    _s("temperature", "FP32", [1], "0 (greedy) if no temperature/top_k/top_p, else 1.0", "sampling temperature"),
    _s("top_k", "INT32", [1], "0 (off)", "sample from the k most likely tokens; <= 0 = off"),
    _s("runtime_top_k", "INT32", [1], "-", "`tensorrt_llm` spelling of `top_k`", alias_of="top_k"),
    _s("top_p", "FP32", [1], "1.0 (off)", "nucleus sampling mass; <= 0 or 1 = off"),
    _s("runtime_top_p", "FP32", [1], "-", "`tensorrt_llm` spelling of `top_p`", alias_of="top_p"),
    _s("seed", "UINT64", [1], "random", "sampling seed"),
    _s("random_seed", "UINT64", [1], "random", "TensorRT-LLM spelling of `seed`", alias_of="seed"),
    _s("stop_words", "STRING", [-1], "none",
       "strings whose token sequences end generation (kept in the output, as TensorRT-LLM)"),
    _s("stop_words_list", "INT32", [2, -1], "none",
       "`tensorrt_llm` stop words: [flat token ids; end offsets], -1 padded"),
    _s("bad_words", "STRING", [-1], "none", "strings whose token sequences are never generated"),
    _s("bad_words_list", "INT32", [2, -1], "none", "`tensorrt_llm` bad words: [flat token ids; end offsets]"),
    _s("embedding_bias_words", "STRING", [-1], "none",
       "the ensemble's logit bias: each word's token ids get the weight of the same index added"),
    _s("embedding_bias_weights", "FP32", [-1], "none", "the weights of `embedding_bias_words`"),
    _s("embedding_bias", "FP32", [-1], "none",
       "`tensorrt_llm` logit bias: one value per token id (its nonzero entries, at most 300, clamped to +-100)"),
    _s("lora_task_id", "UINT64", [1], "none",
       "a LoRA adapter (docs/lora.md): the id of weights sent before, or of `lora_weights` sent now"),
    _s("lora_weights", "FP16", [-1, -1], "none",
       "TensorRT-LLM's LoRA weights: per `lora_config` row, A [D, in] then B [out, D] flattened (hf_lora_convert.py)"),
    _s("lora_config", "INT32", [-1, 3], "none", "TensorRT-LLM's LoRA rows: module id, layer, adapter size D"),
    _s("specguide_lora", "STRING", [1], "-",
       "a LoRA control request, alone: JSON `{\"action\": \"load\" | \"unload\" | \"list\", \"lora_name\", "
       "\"lora_path\", \"load_inplace\"}` (docs/lora.md); answered by one response, its `text_output` JSON"),
    _s("end_id", "INT32", [1], "the tokenizer's EOS", "token id that ends generation"),
    _s("pad_id", "INT32", [1], "-", "accepted and ignored"),
    _s("num_return_sequences", "INT32", [1], "1",
       "sequences per prompt (each its own seed); responses carry `sequence_index`"),
    _s("num_draft_tokens", "INT32", [1], "the configured K", "draft tokens per step; 0 turns speculation off"),
    _s("guided_decoding_guide_type", "STRING", [1], "none",
       "one of `json`, `json_schema`, `regex`, `ebnf_grammar`, `structural_tag`, `choice`"),
    _s("guided_decoding_guide", "STRING", [1], "\"\"", "the schema / regex / grammar / tag / JSON list of choices"),
    _s("sampling_parameters", "STRING", [1], "none",
       "vLLM backend JSON (max_tokens 16, temperature 1.0 when given); individual tensors override it"),
    _s("return_log_probs", "BOOL", [1], "false", "add `cum_log_probs` and `output_log_probs`"),
    _s("return_context_logits", "BOOL", [1], "false", "add `context_logits` (the prompt's logits)"),
    _s("return_generation_logits", "BOOL", [1], "false", "add `generation_logits` (each new token's logits)"),
    _s("return_num_input_tokens", "BOOL", [1], "false", "add `num_input_tokens` and `num_cached_tokens`"),
    _s("return_num_output_tokens", "BOOL", [1], "false", "add `num_output_tokens`"),
    _s("return_perf_metrics", "BOOL", [1], "false", "add the timing, KV-cache and draft-token outputs"),
    _s("beam_width", "INT32", [1], "1", "only 1 is supported"),
    _s("frequency_penalty", "FP32", [1], "0 (off)",
       "in [-2, 2]; subtracted from a token's logit once per occurrence in the output (OpenAI/vLLM)"),
    _s("presence_penalty", "FP32", [1], "0 (off)",
       "in [-2, 2]; subtracted once from the logits of tokens already in the output (OpenAI/vLLM)"),
    _s("repetition_penalty", "FP32", [1], "1.0 (off)",
       "> 0; divides positive / multiplies negative logits of tokens in the prompt or output (HF/TRT-LLM)"),
    _s("length_penalty", "FP32", [1], "1", "accepted and ignored (beam search only)"),
    _s("len_penalty", "FP32", [1], "-", "`tensorrt_llm` spelling of `length_penalty`", alias_of="length_penalty"),
    _s("stop", "BOOL", [1], "false",
       "TensorRT-LLM's stop signal: `true` stops the running request with the same request id"),
    _s("timeout_s", "FP32", [1], "`request_timeout_s` (0 = none)",
       "time limit from arrival (queue + generation); past it the request ends with `finish_reason` `timeout`"),
    # vLLM-only: passed on by specguide_vllm, refused here otherwise
    _s("return_finish_reason", "BOOL", [1], "false", "vLLM: add `finish_reason`", vllm_only=True),
    _s("return_cumulative_logprob", "BOOL", [1], "false", "vLLM: add `cumulative_logprob`", vllm_only=True),
    _s("return_logprobs", "BOOL", [1], "false",
       "add `logprobs` (vLLM's JSON: each token's log prob, rank and text, and the top `logprobs: N` of "
       "`sampling_parameters`, default 0)"),
)

TRTLLM_OUTPUTS: tuple[Spec, ...] = (
    _s("text_output", "STRING", [-1], "", "one string per response ([1]): the new text when streaming, else all of it"),
    _s("output_ids", "INT32", [-1, -1], "", "[1, 1, n] (batch, beam, tokens): the ids matching `text_output`"),
    _s("sequence_length", "INT32", [-1], "", "[1, 1]: the length of `output_ids`"),
    _s("finish_reason", "STRING", [1], "", "`stop`, `length` or `timeout` on a sequence's last response, \"\" before"),
    _s("batch_index", "INT32", [1], "", "the request row this response belongs to"),
    _s("sequence_index", "INT32", [1], "", "which of the row's `num_return_sequences`"),
    _s("num_input_tokens", "UINT32", [1], "", "prompt tokens (with `return_num_input_tokens`)"),
    _s("num_output_tokens", "UINT32", [1], "", "generated tokens in this response (with `return_num_output_tokens`)"),
    _s("num_cached_tokens", "UINT32", [1], "",
       "prompt tokens whose KV came from the prefix cache, not computed (with `return_num_input_tokens`)"),
    _s("cum_log_probs", "FP32", [-1], "", "[1, 1]: sum of the log probs so far (with `return_log_probs`)"),
    _s("output_log_probs", "FP32", [-1, -1], "", "[1, 1, n]: each new token's log prob (with `return_log_probs`)"),
    _s("context_logits", "FP32", [-1, -1], "", "[1, prompt, vocab] (with `return_context_logits`)"),
    _s("generation_logits", "FP32", [-1, -1, -1], "", "[1, 1, n, vocab] (with `return_generation_logits`)"),
    _s("kv_cache_alloc_new_blocks", "INT32", [1], "", "KV blocks this sequence allocated (with `return_perf_metrics`)"),
    _s("kv_cache_reused_blocks", "INT32", [1], "", "KV blocks reused from a cached prefix (with `return_perf_metrics`)"),
    _s("kv_cache_alloc_total_blocks", "INT32", [1], "", "KV blocks held (with `return_perf_metrics`)"),
    _s("arrival_time_ns", "INT64", [1], "", "wall clock at arrival (with `return_perf_metrics`)"),
    _s("first_scheduled_time_ns", "INT64", [1], "", "wall clock when it got a slot (with `return_perf_metrics`)"),
    _s("first_token_time_ns", "INT64", [1], "", "wall clock of the first token (with `return_perf_metrics`)"),
    _s("last_token_time_ns", "INT64", [1], "", "wall clock of the latest token (with `return_perf_metrics`)"),
    _s("acceptance_rate", "FP32", [1], "", "accepted / proposed draft tokens (with `return_perf_metrics`)"),
    _s("total_accepted_draft_tokens", "INT32", [1], "", "draft tokens accepted so far (with `return_perf_metrics`)"),
    _s("total_draft_tokens", "INT32", [1], "", "draft tokens proposed so far (with `return_perf_metrics`)"),
    _s("guide_notes", "STRING", [-1], "", "last response of a JSON guide whose grammar leaves keywords to the "
       "value check or unenforced: one note each (\"checked when its value closes: uniqueItems at /l\")"),
    _s("specguide_error", "STRING", [2], "", "[code, message]: sent only to the proxies (`specguide_vllm`, "
       "`specguide_unary`), which answer their client with that error (PROXY_ERROR)"),
    # vLLM-only outputs, sent only through specguide_vllm
    _s("cumulative_logprob", "FP32", [-1], "", "vLLM: sum of the log probs so far", vllm_only=True),
    _s("logprobs", "STRING", [-1], "", "JSON list of {token_id: {logprob, rank, decoded_token}} (with "
       "`return_logprobs`)"),
    _s("prompt_logprobs", "STRING", [-1], "", "JSON list, once: {token_id: {logprob, rank, decoded_token}} per "
       "prompt token, null log prob for the first (`prompt_logprobs: N` in sampling_parameters)"),
)

# ------------------------------------------------------------------------------ vLLM backend

VLLM_INPUTS: tuple[Spec, ...] = (
    _s("text_input", "STRING", [1], "-", "prompt text"),
    _s("image", "STRING", [-1], "-", "base64 images: refused (no vision model)"),
    _s("stream", "BOOL", [1], "false", "one response per step"),
    _s("sampling_parameters", "STRING", [1], "vLLM's", "vLLM SamplingParams as JSON"),
    _s("exclude_input_in_output", "BOOL", [1], "true if streaming, else false", "leave the prompt out"),
    _s("return_finish_reason", "BOOL", [1], "false", "add `finish_reason`"),
    _s("return_cumulative_logprob", "BOOL", [1], "false", "add `cumulative_logprob`"),
    _s("return_logprobs", "BOOL", [1], "false", "add `logprobs`"),
    _s("return_num_input_tokens", "BOOL", [1], "false", "add `num_input_tokens`"),
    _s("return_num_output_tokens", "BOOL", [1], "false", "add `num_output_tokens`"),
    _s("embedding_request", "STRING", [1], "-", "reserved for embeddings: refused"),
)

VLLM_OUTPUTS: tuple[Spec, ...] = (
    _s("text_output", "STRING", [-1], "", "the new text when streaming, else all of it"),
    _s("finish_reason", "STRING", [-1], "", "`None` before the last response, then `stop`, `length` or `abort`"),
    _s("cumulative_logprob", "FP32", [-1], "", "sum of the log probs so far"),
    _s("logprobs", "STRING", [-1], "", "JSON list of {token_id: {logprob, rank, decoded_token}} (null without "
       "`logprobs` in sampling_parameters)"),
    _s("num_input_tokens", "UINT32", [1], "", "prompt tokens"),
    _s("num_output_tokens", "UINT32", [-1], "", "new tokens in this response"),
)

INTERFACES: dict[str, Interface] = {
    i.name: i
    for i in (
        Interface("specguide", TRTLLM_INPUTS, TRTLLM_OUTPUTS, decoupled=True, max_batch_size=64, kind="engine",
                  doc="the TensorRT-LLM interface (ensemble + tensorrt_llm names), decoupled; hosts the engine"),
        Interface("specguide_unary", TRTLLM_INPUTS, TRTLLM_OUTPUTS, decoupled=False, max_batch_size=64, kind="unary",
                  doc="the TensorRT-LLM interface, one response per request (ModelInfer / infer / HTTP /infer)"),
        Interface("specguide_vllm", VLLM_INPUTS, VLLM_OUTPUTS, decoupled=True, max_batch_size=0, kind="vllm",
                  required=("text_input",), doc="the vLLM backend's interface exactly"),
    )
}

# what each front end accepts: the `specguide` engine model gets requests of all three kinds
# and tells them apart by the BLS parameter INTERFACE_PARAMETER.
INTERFACE_PARAMETER = "specguide_interface"
# and the proxy's own model name and version, which label the metrics of the traffic it forwards
# (triton/peer_metrics.py: a dashboard of model="specguide_vllm" sees that model's requests)
SERVED_MODEL_PARAMETER = "specguide_served_model"
SERVED_VERSION_PARAMETER = "specguide_served_version"
# NOTE: Triton 2.51's Python backend (python_backend < r25.04, InferResponse::SaveToSharedMemory)
# loses the id of a decoupled BLS error response that follows another response: the proxy's
# response iterator never sees it and its client waits forever. So the engine model sends the
# proxies every error as this output instead, and the proxy turns it back into the error.
PROXY_ERROR = "specguide_error"
# A client of `specguide` may ask for its errors as that output too (request parameter, true): a gRPC
# stream carries an error's message but not its code, and the OpenAI server answers by the code
# (400 / 429 / 503 / 500). Triton's own `triton_grpc_error` header would keep it, but 2.51 logs a
# spurious cancellation for each such stream and once crashed on one (SIGSEGV in infer_handler.h).
ERROR_OUTPUT_PARAMETER = "specguide_error_output"
TRTLLM_INPUT_NAMES = tuple(s.name for s in TRTLLM_INPUTS if not s.vllm_only)
VLLM_INPUT_NAMES = tuple(s.name for s in VLLM_INPUTS)
ALIASES: dict[str, str] = {s.name: s.alias_of for s in TRTLLM_INPUTS if s.alias_of}


# ------------------------------------------------------------------------------ config.pbtxt


def _tensor_block(specs: tuple[Spec, ...], required: tuple[str, ...], inputs: bool) -> str:
    items = []
    for s in specs:
        dims = ", ".join(str(d) for d in s.dims)
        lines = [f'    name: "{s.name}"', f"    data_type: {s.dtype}", f"    dims: [ {dims} ]"]
        if inputs and s.name not in required:
            lines.append("    optional: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return ",\n".join(items)


def render_config(iface: Interface) -> str:
    """The generated part of `model_repository/<name>/config.pbtxt`."""
    out = [
        f"# {iface.name}: {iface.doc}.",
        "# GENERATED from backend_src/specguide/triton/interfaces.py by",
        "# `python -m specguide.triton.interfaces`: edit that file, not this one.",
        f'name: "{iface.name}"',
        'backend: "python"',
        f"max_batch_size: {iface.max_batch_size}",
    ]
    if iface.decoupled:
        out.append("model_transaction_policy {\n  decoupled: true\n}")
    out.append("input [\n" + _tensor_block(iface.inputs, iface.required, True) + "\n]")
    out.append("output [\n" + _tensor_block(iface.outputs, (), False) + "\n]")
    if iface.kind == "engine":
        out.append("# KIND_MODEL: the engine places itself (parameter `device`: cpu | cuda | cuda:N | auto).")
        out.append("instance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]")
    else:
        out.append("# a BLS proxy: its requests run in the engine of the `specguide` model")
        out.append("instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]")
        out.append(f'parameters {{\n  key: "interface"\n  value: {{ string_value: "{iface.kind}" }}\n}}')
        out.append(f'parameters {{\n  key: "engine_model"\n  value: {{ string_value: "{ENGINE_MODEL}" }}\n}}')
    return "\n".join(out) + "\n"


MODEL_PY = {
    "engine": "specguide.triton.adapter",
    "unary": "specguide.triton.proxy",
    "vllm": "specguide.triton.proxy",
}


def config_text(iface: Interface, existing: str = "") -> str:
    """The whole config.pbtxt: the generated part, then (engine only) the hand-kept settings."""
    text = render_config(iface)
    if iface.kind == "engine":
        _, marker, settings = existing.partition(ENGINE_SETTINGS_MARKER)
        if not marker:
            raise ValueError(f"{iface.name}/config.pbtxt lost its line {ENGINE_SETTINGS_MARKER!r}")
        text += "\n" + ENGINE_SETTINGS_MARKER + settings
    return text


def write_configs(repo: Path, check: bool = False) -> list[str]:
    """Write every interface's config.pbtxt under `repo`; with check, only list the stale ones."""
    stale = []
    for iface in INTERFACES.values():
        path = repo / iface.name / "config.pbtxt"
        existing = path.read_text() if path.exists() else ""
        want = config_text(iface, existing)
        if existing != want:
            stale.append(str(path))
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(want)
    return stale


def engine_parameters(repo: Path) -> dict[str, str]:
    """The engine settings of `repo/specguide/config.pbtxt` as the adapter receives them
    (`{key: string_value}`; Triton's own parser: the protobuf text format of ModelConfig)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(repo) / ENGINE_MODEL / "config.pbtxt"
    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    return {key: value.string_value for key, value in config.parameters.items()}


def main(argv: list[str]) -> int:
    repo = Path(__file__).resolve().parents[3] / "model_repository"
    stale = write_configs(repo, check="--check" in argv)
    for p in stale:
        print(("stale: " if "--check" in argv else "wrote: ") + p)
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
