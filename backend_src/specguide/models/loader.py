"""Weight loading: a Hugging Face folder (safetensors) or a GGUF file (converted once, cached)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..paths import cache_dir
from .default_model import convert_gguf, prepare_default_model
from .llama import LlamaModel, ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def resolve_model_dir(model_dir: str = "", gguf_file: str = "") -> Path:
    """The safetensors folder to load: the default model, a GGUF converted once, or `model_dir`."""
    if not model_dir:
        return prepare_default_model()
    path = Path(model_dir)
    if gguf_file:
        gguf = path / gguf_file
        key = hashlib.sha1(f"{gguf.resolve()}:{gguf.stat().st_size}".encode()).hexdigest()[:12]
        out = cache_dir() / "models" / f"{gguf.stem}-{key}"
        if not (out / "model.safetensors").exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(gguf, out)
        return out
    return path


def load_model(folder: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               weight_dtype: str = "float32") -> LlamaModel:
    """Build a LlamaModel from an HF folder, fusing q|k|v and gate|up; linear weights held in
    `weight_dtype` (see `LlamaModel.finalize`)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = Path(folder)
    hf = AutoConfig.from_pretrained(folder)
    if hf.model_type not in SUPPORTED:
        arch = ", ".join(getattr(hf, "architectures", None) or [hf.model_type])
        raise ValueError(f"{folder}: architecture {arch} (model_type {hf.model_type!r}) is not supported "
                         f"(supported model types: {', '.join(SUPPORTED)})")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"{folder}: partial_rotary_factor {hf.partial_rotary_factor} is not supported (only 1.0)")
    cfg = ModelConfig.from_hf(hf)
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    with torch.device("meta"):
        model = LlamaModel(cfg, torch.zeros(cfg.head_dim // 2), scaling)
    model.load_state_dict(_remap(state, cfg), strict=True, assign=True)
    model.inv_freq = inv_freq.float()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    model.finalize(weight_dtype)
    eos = hf.eos_token_id
    model.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    return model


def _remap(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {"embed.weight": state["model.embed_tokens.weight"],
                                    "norm": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.input_norm"] = state[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_norm"] = state[p + "post_attention_layernorm.weight"]
        if a + "qkv_proj.weight" in state:  # Phi-3: fused in the checkpoint already
            out[f"layers.{i}.qkv.weight"] = state[a + "qkv_proj.weight"]
        else:
            out[f"layers.{i}.qkv.weight"] = torch.cat([state[a + f"{n}_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([state[a + f"{n}_proj.bias"] for n in "qkv"])
        if cfg.qk_norm:
            out[f"layers.{i}.q_norm"] = state[a + "q_norm.weight"]
            out[f"layers.{i}.k_norm"] = state[a + "k_norm.weight"]
        out[f"layers.{i}.o.weight"] = state[a + "o_proj.weight"]
        if p + "mlp.gate_up_proj.weight" in state:  # Phi-3: gate|up fused, gate first
            out[f"layers.{i}.gate_up.weight"] = state[p + "mlp.gate_up_proj.weight"]
        else:
            out[f"layers.{i}.gate_up.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"],
                                                           state[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.down.weight"] = state[p + "mlp.down_proj.weight"]
    return out
