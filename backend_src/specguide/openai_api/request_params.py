"""OpenAI sampling fields -> the `specguide` model's vLLM `sampling_parameters` and inputs.

Checked here with the model's own code (`sampling_from_vllm`, `SamplingParams.validate`), so a
value Triton would refuse is a 400 naming the field before anything is sent. Fields we know but
do not serve are refused with why; neutral values of them are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..request import InvalidRequestError
from ..triton.vllm_params import sampling_from_vllm
from .errors import bad_request, unsupported
from .guides import Guide
from .schemas import ChatCompletionRequest, CompletionRequest
from .triton_client import TritonRequest

# field -> (values accepted as "not asked for", why anything else is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "one sequence is generated per choice (no best-of search)"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None, {}), "metadata only goes with store, which is not supported"),
    "use_beam_search": ((None, False), "beam search is not implemented"),
    "functions": ((None,), "the deprecated functions API; use tools"),
    "function_call": ((None,), "the deprecated functions API; use tool_choice"),
    "modalities": ((None, ["text"]), "this model generates text only"),
    "audio": ((None,), "this model generates text only"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "reasoning_effort": ((None,), "reasoning effort is not adjustable here"),
    "web_search_options": ((None,), "there is no web search"),
    "verbosity": ((None,), "verbosity is not adjustable here"),
    "chat_template": ((None,), "the model's own chat template is used"),
    "add_generation_prompt": ((None, True), "the generation prompt is always added"),
    "continue_final_message": ((None, False), "a final assistant message cannot be continued"),
    "suffix": ((None, ""), "insertion (fill in the middle) is not supported by this model"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always left out of the text"),
}


@dataclass
class Limits:
    """What the served model allows (read from its config at start-up)."""

    max_tokens_limit: int = 2048  # the model's max_tokens_limit (= max_seq_len by default)


def check_refused(req: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    for name, (neutral, why) in REFUSED.items():
        if name in type(req).model_fields and getattr(req, name) not in neutral:
            raise unsupported(name, why)


def _stops(stop: Union[str, list[str], None]) -> Optional[list[str]]:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else list(stop)
    return [s for s in stops if s] or None


def build(req: Union[ChatCompletionRequest, CompletionRequest], prompt: Union[str, list[int]], guide: Optional[Guide],
          max_tokens: Optional[int], default_max_tokens: int, top_logprobs: Optional[int],
          limits: Limits, model_name: str = "") -> TritonRequest:
    """The TritonRequest for one prompt of `req` (n sequences); a `model` other than `model_name`
    names a LoRA adapter (the engine checks it serves one)."""
    check_refused(req)
    sp: dict[str, Any] = {"max_tokens": max_tokens or min(default_max_tokens, limits.max_tokens_limit)}
    if model_name and req.model != model_name:
        sp["lora_name"] = req.model
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "top_k", "min_tokens",
                "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "stop_token_ids", "bad_words"):
        value = getattr(req, key)
        if value is not None:
            sp[key] = value
    if req.seed is not None:
        sp["seed"] = req.seed % 2**64  # OpenAI's seed is a signed 64-bit integer
    if req.logit_bias:
        sp["logit_bias"] = req.logit_bias
    if req.prompt_logprobs is not None:
        if req.stream:
            raise unsupported("prompt_logprobs", "prompt log probs come in whole answers (stream: false), as vLLM's")
        sp["prompt_logprobs"] = req.prompt_logprobs
    stops = _stops(req.stop)
    if stops:
        sp["stop"] = stops
    if top_logprobs is not None:
        sp["logprobs"] = top_logprobs
    if guide is not None:
        sp["structured_outputs"] = guide.structured_outputs
    _validate(sp, limits, "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens")
    return TritonRequest(prompt=prompt, sampling=sp, stream=bool(req.stream), n=req.n or 1,
                         num_draft_tokens=req.num_draft_tokens, logprobs=top_logprobs is not None,
                         prompt_logprobs=req.prompt_logprobs is not None,
                         guide_param=guide.param if guide else None)


def _validate(sp: dict[str, Any], limits: Limits, max_tokens_field: str) -> None:
    """The model's own checks of these values; the message names the field."""
    try:
        # bad words need the model's tokenizer: the model checks them (a 400 from Triton)
        params = sampling_from_vllm({k: v for k, v in sp.items() if k not in ("structured_outputs", "bad_words")}, None)
        params.validate(limits.max_tokens_limit)
    except InvalidRequestError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = max_tokens_field if field == "max_tokens" else field if field in sp else None
        raise bad_request(message, param) from None
