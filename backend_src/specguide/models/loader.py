"""Weight loading: a Hugging Face folder (safetensors) or a GGUF file (converted once, cached)."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import kernels
from ..util.paths import cache_dir
from ..util.progress import Progress
from . import gemma, packed_cache
from .default_model import convert_gguf, prepare_default_model
from .llama import LlamaModel, ModelConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3")


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
               weight_dtype: str = "float32", integer_dot: bool = False, cache: bool = False) -> LlamaModel:
    """Build a LlamaModel from an HF folder, fusing q|k|v and gate|up; linear weights held in
    `weight_dtype`, block formats in integer dot products with `integer_dot` (see `LlamaModel.finalize`).
    `cache`: the C kernels' packed weights are read from the packed-weights cache, or packed and
    written there (packed_cache.py; CPU, float32, C kernels built: elsewhere nothing is packed so)."""
    from transformers import AutoConfig

    folder = Path(folder)
    if device == "cpu" and dtype == torch.bfloat16 and not cpu_bf16_matmuls():
        raise ValueError("dtype bfloat16: torch's CPU bf16 matmuls need AVX-512 (bw, vl, dq) or AVX-NE-CONVERT, "
                         "which this CPU lacks; use dtype float32 (weight_dtype bfloat16 still holds the "
                         "weights in bf16, with fp32 math in the C kernels)")
    top = AutoConfig.from_pretrained(folder)
    if top.model_type not in SUPPORTED:
        arch = ", ".join(getattr(top, "architectures", None) or [top.model_type])
        raise ValueError(f"{folder}: architecture {arch} (model_type {top.model_type!r}) is not supported "
                         f"(supported model types: {', '.join(SUPPORTED)})")
    hf = gemma.text_config(top)  # a multimodal Gemma 3: its text model only
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"{folder}: hidden_act {hf.hidden_act!r} is not supported (only silu)")
    if float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ValueError(f"{folder}: partial_rotary_factor {hf.partial_rotary_factor} is not supported (only 1.0)")
    if why := gemma.unsupported(hf):
        raise ValueError(f"{folder}: {why}")
    cfg = ModelConfig.from_hf(hf)
    per_type = "full_attention" in (getattr(hf, "rope_parameters", None) or {})  # Gemma 3: RoPE per layer type
    inv_freq, scaling = _rope(hf, cfg.head_dim, "full_attention" if per_type else None)
    local = _rope(hf, cfg.head_dim, "sliding_attention") if per_type and any(cfg.sliding) else None
    state: dict[str, torch.Tensor] = {}
    files = weight_files(folder)
    progress = Progress(f"load {folder.name}", len(files), "safetensors files") if len(files) > 1 else None
    for f in files:
        state.update(load_file(str(f)))
        if progress is not None:
            progress.update()
    with torch.device("meta"):
        model = LlamaModel(cfg, torch.zeros(cfg.head_dim // 2), scaling,
                           None if local is None else (torch.zeros(cfg.head_dim // 2), local[1]))
    store = (packed_cache.PackedCache(folder, files, weight_dtype, integer_dot)
             if cache and device == "cpu" and dtype == torch.float32 and kernels.library() is not None else None)
    packed = None if store is None else store.load(packed_cache.linear_shapes(model))
    # NOTE: safetensors maps the files lazily: with the packed weights cached, the linears' are never read
    tensors = _remap(state, cfg, hf.model_type in gemma.GEMMA, linears=packed is None)
    keys = model.load_state_dict(tensors, strict=packed is None, assign=True)
    if packed is not None:
        packed_cache.install(model, packed, keys.missing_keys + keys.unexpected_keys)
    model.inv_freq = inv_freq.float()
    if local is not None:
        model.inv_freq_local = local[0].float()
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    _own_memory(model, tensors)
    model.finalize(weight_dtype, integer_dot)
    if store is not None and packed is None:
        store.save(model)
    model.eos_token_ids = eos_token_ids(folder, top, hf)
    return model


PACKED = re.compile(r"layers\.\d+\.(qkv|o|gate_up|down)\.weight")  # replaced by their packed form in finalize


def _own_memory(model: LlamaModel, loaded: dict[str, torch.Tensor]) -> None:
    """Copy the tensors `.to()` left as loaded (CPU, the checkpoint's dtype), but the layers' linear
    weights (packed, then dropped): they still map the checkpoint file (safetensors' mmap), which
    then stayed mapped with every page the load read, the linears' too: ~500 MiB more resident
    (file) memory after a load that packs the default model in float32 than after one that reads
    the packed-weights cache. With its own copies the engine holds the same memory either way and
    the file is unmapped when the load returns (a page the kernel dropped from a mapping is read
    back from disk at its next use, e.g. on the first request after an idle spell)."""
    mapped = {t.data_ptr() for t in loaded.values() if t.device.type == "cpu"}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if p is not None and p.device.type == "cpu" and p.data_ptr() in mapped and not PACKED.fullmatch(name):
            p.data = p.data.clone()


def cpu_bf16_matmuls() -> bool:
    """Whether torch runs bf16 matmuls on this CPU (oneDNN's check: AVX-512 bw/vl/dq or AVX-NE-CONVERT;
    elsewhere a bf16 forward raises at its first linear)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def eos_token_ids(folder: Path, *configs) -> frozenset[int]:
    """End-of-sequence ids: config.json's (the top config's, else the text model's) and
    generation_config.json's (Llama 3, Qwen2.5 and Gemma 3 instruct models list their end-of-turn
    tokens only there), as vLLM merges them."""
    out: set[int] = set()
    gen = folder / "generation_config.json"
    sources = [next((c.eos_token_id for c in configs if getattr(c, "eos_token_id", None) is not None), None)]
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for eos in sources:
        out.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(out)


def weight_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors: the shards its `model.safetensors.index.json` names, else
    `model.safetensors`, else every `*.safetensors` (NOTE: Mistral's folders also hold a
    `consolidated.safetensors` in another layout: reading it too would double the memory)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "model.safetensors"
    files = [single] if single.exists() else sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def _rope(hf, head_dim: int, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) of the RoPE of `layer_type` (None: the model's one RoPE)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope = rope[layer_type] if layer_type else rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu", **({"layer_type": layer_type} if layer_type else {}))


def _remap(state: dict[str, torch.Tensor], cfg: ModelConfig, norm_plus_one: bool = False,
           linears: bool = True) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under LlamaModel's names (q|k|v and gate|up fused); `linears` False
    leaves the layers' linear weights out (read from the packed-weights cache instead)."""
    m = gemma.weight_prefix(state)
    head = "language_model.lm_head.weight" if m.startswith("language_model.") else "lm_head.weight"
    out: dict[str, torch.Tensor] = {"embed.weight": state[m + "embed_tokens.weight"], "norm": state[m + "norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state.get(head, state[m + "embed_tokens.weight"])
    for i in range(cfg.num_layers):
        p = f"{m}layers.{i}."
        a = p + "self_attn."
        out[f"layers.{i}.input_norm"] = state[p + "input_layernorm.weight"]
        if cfg.sandwich_norm:  # Gemma 2/3: post-attention, pre- and post-feedforward norms
            out[f"layers.{i}.attn_out_norm"] = state[p + "post_attention_layernorm.weight"]
            out[f"layers.{i}.post_norm"] = state[p + "pre_feedforward_layernorm.weight"]
            out[f"layers.{i}.mlp_out_norm"] = state[p + "post_feedforward_layernorm.weight"]
        else:
            out[f"layers.{i}.post_norm"] = state[p + "post_attention_layernorm.weight"]
        if cfg.qkv_bias:
            out[f"layers.{i}.qkv.bias"] = torch.cat([state[a + f"{n}_proj.bias"] for n in "qkv"])
        if cfg.qk_norm:
            out[f"layers.{i}.q_norm"] = state[a + "q_norm.weight"]
            out[f"layers.{i}.k_norm"] = state[a + "k_norm.weight"]
        if not linears:
            continue
        if a + "qkv_proj.weight" in state:  # Phi-3: fused in the checkpoint already
            out[f"layers.{i}.qkv.weight"] = state[a + "qkv_proj.weight"]
        else:
            out[f"layers.{i}.qkv.weight"] = torch.cat([state[a + f"{n}_proj.weight"] for n in "qkv"])
        out[f"layers.{i}.o.weight"] = state[a + "o_proj.weight"]
        if p + "mlp.gate_up_proj.weight" in state:  # Phi-3: gate|up fused, gate first
            out[f"layers.{i}.gate_up.weight"] = state[p + "mlp.gate_up_proj.weight"]
        else:
            out[f"layers.{i}.gate_up.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"],
                                                           state[p + "mlp.up_proj.weight"]])
        out[f"layers.{i}.down.weight"] = state[p + "mlp.down_proj.weight"]
    if norm_plus_one:  # Gemma's RMSNorm scales by 1 + w: stored so, computed in fp32 as transformers does
        out = {k: v.float() + 1.0 if k.endswith("norm") else v for k, v in out.items()}
    return out
