"""Gemma 2 / Gemma 3 (text) on the Llama-family decoder: what differs, read from the HF config.

* RMSNorm scaled by (1 + w): the loader stores 1 + w (in fp32, as transformers computes it), so
  every norm stays a plain RMSNorm.
* embeddings times sqrt(hidden_size), GeGLU MLP (gelu tanh), a norm on each branch's output
  before its residual add (pre/post attention and feed-forward norms).
* q.k scaled by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps attention scores and logits.
* sliding-window layers (`layer_types`, read by llama.sliding_fields): Gemma 2 every other layer,
  Gemma 3 five in six, with their own RoPE theta (Gemma 3: rope_parameters["sliding_attention"]);
  Gemma 3 q/k norms.
* "gemma3" multimodal checkpoints: the text model only (its `text_config` and weights).
"""
from __future__ import annotations

from typing import Any

GEMMA = ("gemma2", "gemma3_text")
MULTIMODAL = {"gemma3": "gemma3_text"}  # model_type -> the text model it holds
# where the text model's weights live: plain CausalLM, then multimodal (transformers 5 and 4 names)
PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def text_config(hf: Any) -> Any:
    """The text model's config (a multimodal Gemma 3's `text_config`)."""
    return hf.text_config if hf.model_type in MULTIMODAL else hf


def unsupported(hf: Any) -> str:
    """Why this Gemma config cannot be served ("" when it can)."""
    if hf.model_type not in GEMMA:
        return ""
    if getattr(hf, "hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        return f"hidden_activation {hf.hidden_activation!r} is not supported (only gelu_pytorch_tanh)"
    if getattr(hf, "use_bidirectional_attention", False):
        return "use_bidirectional_attention is not supported (causal attention only)"
    if getattr(hf, "attention_bias", False):
        return "attention_bias is not supported"
    return ""


def gemma_fields(hf: Any) -> dict[str, Any]:
    """ModelConfig fields for a Gemma text config ({} for other model types)."""
    if hf.model_type not in GEMMA:
        return {}
    return {
        "act": "gelu_tanh", "sandwich_norm": True, "embed_scale": hf.hidden_size ** 0.5,
        "attn_scale": hf.query_pre_attn_scalar ** -0.5,
        # NOTE: transformers' Gemma 3 ignores attn_logit_softcapping (it never passes it on)
        "attn_softcap": float(hf.attn_logit_softcapping or 0.0) if hf.model_type == "gemma2" else 0.0,
        "final_softcap": float(getattr(hf, "final_logit_softcapping", None) or 0.0),
    }  # the sliding-window layers (`layer_types`) are read as for every model: llama.sliding_fields


def weight_prefix(state: dict, default: str = "model.") -> str:
    """The prefix of the text model's weights in a checkpoint (`model.` unless multimodal)."""
    return next((p for p in PREFIXES if p + "embed_tokens.weight" in state), default)
