"""A Llama-family model folder with random weights in a real model's shape, for GPU checks and
benchmarks where only shapes and speed matter (no weights travel to a lent GPU machine).

    python scripts/make_random_model.py --shape llama-3.2-1b --out /tmp/llama1b [--dtype bfloat16]
                                        [--tokenizer DIR] [--device cuda]

The tokenizer (and chat template) is the default model's (`--tokenizer`, default: the cached
SmolLM2 folder); a shape whose vocabulary is larger keeps the extra ids unused by the tokenizer, as
padded vocabularies do. Weights: N(0, 0.02) for linears and embeddings, ones for the norms, seeded.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

SHAPES = {  # the config.json fields that differ from SmolLM2-135M's
    "smollm2-135m": {},
    # one small layer, the real vocabulary: a forward that costs next to nothing (bench/bench_host.py)
    "host-probe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
                       num_key_value_heads=1, head_dim=64),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF Llama parameter names and shapes for config `c`."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def make(shape: str, out: Path, tokenizer: Path, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """Write config.json, the tokenizer files and a random model.safetensors under `out`."""
    from safetensors.torch import save_file

    config = json.loads((tokenizer / "config.json").read_text())
    config.update(SHAPES[shape])
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("_name_or_path", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    gen = torch.Generator(device).manual_seed(seed)
    tensors = {}
    for name, size in weight_shapes(config).items():
        if len(size) == 1:
            t = torch.ones(size, dtype=dtype)
        else:
            t = (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype).cpu()
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", default="", help="folder with config.json + tokenizer files (default: the "
                                                    "cached default model's)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the random numbers are drawn (a GPU draws an 8B model in seconds)")
    args = ap.parse_args()
    if args.tokenizer:
        tok = Path(args.tokenizer)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend_src"))
        from specguide.models.default_model import prepare_default_model

        tok = prepare_default_model()
    print(make(args.shape, Path(args.out), tok, getattr(torch, args.dtype), args.device))


if __name__ == "__main__":
    main()
