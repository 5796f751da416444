"""Random LoRA adapters for the tests, made and saved by `peft` on the default model (float32)."""
from __future__ import annotations

from pathlib import Path

import torch

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {  # name -> LoraConfig arguments (alpha well below r: the adapters move the text, not wreck it)
    "support": dict(r=8, lora_alpha=2, target_modules=ALL),
    "legal": dict(r=16, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                  alpha_pattern={"down_proj": 2}),
}


def make_adapters(model_dir: Path, root: Path):
    """({name: folder} of the SPECS adapters saved under `root`, the peft model holding them all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    pm = None
    for name, spec in SPECS.items():
        conf = LoraConfig(init_lora_weights=False, **spec)  # random A and B (peft's default B is 0)
        if pm is None:
            pm = get_peft_model(hf, conf, adapter_name=name)
        else:
            pm.add_adapter(name, conf)
    pm.eval()
    pm.save_pretrained(root)
    folders = {name: root / name for name in SPECS}  # peft saves an adapter not named "default" so
    assert all((f / "adapter_model.safetensors").is_file() for f in folders.values())
    return folders, pm


@torch.inference_mode()
def peft_greedy(pm, name, ids: list[int], n: int) -> list[int]:
    """peft's greedy continuation of `ids` with adapter `name` (None: the base model)."""
    def run():
        out = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        return out[0, len(ids):].tolist()

    if name is None:
        with pm.disable_adapter():
            return run()
    pm.set_adapter(name)
    return run()


TRTLLM_IDS = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}


def trtllm_arrays(folder: Path, dtype=None):
    """A PEFT folder as TensorRT-LLM's hf_lora_convert.py writes it: (lora_weights [1, n, size], lora_config
    [1, n, 3] int32); each row A [r, in] then B [out, r] * scale, flattened, zero padded to the longest."""
    import json
    import math
    import re

    import numpy as np
    from safetensors.torch import load_file

    conf = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    rows, config = [], []
    for key in sorted(k for k in tensors if ".lora_A." in k):
        m = re.search(r"layers\.(\d+)\.\w+\.(\w+)\.lora_A", key)
        a, b = tensors[key].float(), tensors[key.replace("lora_A", "lora_B")].float()
        r = a.shape[0]
        alpha = next((v for p, v in (conf.get("alpha_pattern") or {}).items() if m.group(2).endswith(p)),
                     conf["lora_alpha"])
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        rows.append(np.concatenate([a.flatten().numpy(), (b * scale).flatten().numpy()]))
        config.append([TRTLLM_IDS[m.group(2)], int(m.group(1)), r])
    size = max(len(x) for x in rows)
    weights = np.stack([np.pad(x, (0, size - len(x))) for x in rows])[None]
    return weights.astype(dtype or np.float32), np.array(config, np.int32)[None]
