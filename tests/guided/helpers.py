"""Shared helpers for guided tests: sample data, model-free logits, tiny decode loops, checks."""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specguide.guided import GuidedDecoder
from specguide.guided.backend import CompiledGuide
from specguide.request import GuidedDecodingParams
from specguide.training import prompts


def data_dir(name: str) -> Path:
    """The shipped data folder `name` (specguide/training/data, or $SPECGUIDE_DATA_DIR)."""
    folder = prompts.data_dir() / name
    assert folder.is_dir(), f"{folder} is missing"
    return folder


@dataclass
class Sample:
    name: str
    kind: str  # regex | json_schema | ebnf | lark | choice | structural_tag
    params: GuidedDecodingParams
    text: str  # the guide as stored (pattern, schema, grammar, choices)


def load_guided_samples() -> list[Sample]:
    folder = data_dir("guided_samples")
    out = []
    for entry in json.loads((folder / "manifest.json").read_text()):
        text = (folder / entry["file"]).read_text()
        kind = entry["kind"].split()[0]
        if entry["file"].endswith(".regex"):
            text = text[:-1] if text.endswith("\n") else text
            gtype = "regex"
        elif kind in ("ebnf", "lark"):
            gtype = "ebnf_grammar"
        else:
            gtype = kind
        out.append(Sample(entry["file"], kind, GuidedDecodingParams(gtype, text), text))
    return out


def token_bonus(hf_tokenizer, vocab_size: int, stop_ids: list[int]) -> torch.Tensor:
    """A per-token logit bias [V] that steers random decoding to short, closing output."""
    bonus = torch.zeros(vocab_size)
    for tok, i in hf_tokenizer.get_vocab().items():
        if i >= vocab_size:
            continue
        text = hf_tokenizer.convert_tokens_to_string([tok])
        if any(c in text for c in '"}]'):
            bonus[i] += 3.0
        if "@" in text or text == ".":
            bonus[i] += 2.0  # ends email patterns (`[a-z]+@[a-z]+\.[a-z]+`) a random walk would not leave
        if text.strip() == "":
            bonus[i] -= 3.0
        elif text.startswith(" "):
            bonus[i] += 2.0  # ends runs like [a-z]+ that a literal with a space follows
        bonus[i] -= 0.1 * len(text)
    bonus[stop_ids] += 8.0
    return bonus


def target_logits(bonus: torch.Tensor, seed: int, prefix: list[int]) -> torch.Tensor:
    """A deterministic "model": logits [V] that depend only on (seed, prefix)."""
    key = zlib.crc32(torch.tensor(prefix, dtype=torch.int64).numpy().tobytes(), seed) if prefix else seed
    g = torch.Generator().manual_seed(key)
    return torch.rand(bonus.shape[0], generator=g) * 4.0 + bonus


def greedy_decode(dec: GuidedDecoder, slot: int, bonus: torch.Tensor, seed: int, max_steps: int = 400,
                  check_every: int = 0) -> list[int]:
    """Plain guided greedy decoding of one slot (one mask row per step); returns the tokens."""
    out: list[int] = []
    for step in range(max_steps):
        if dec.is_terminated(slot):
            break
        dec.fill([(slot, 0)])
        logits = target_logits(bonus, seed, out)[None]
        dec.apply(logits, [(slot, 0)])
        tok = int(logits.argmax())
        assert dec.advance(slot, tok), f"masked argmax {tok} rejected at step {step}"
        out.append(tok)
        if check_every and step % check_every == 0:
            assert dec.check_fresh(slot, out) is None, dec.check_fresh(slot, out)
    return out


def output_text(hf_tokenizer, tokens: list[int], stop_ids: list[int]) -> str:
    body = [t for t in tokens if t not in stop_ids]
    return hf_tokenizer.decode(body, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def grammar_accepts(compiled: CompiledGuide, tokens: list[int]) -> bool:
    """A fresh matcher accepts the whole token sequence and ends terminated."""
    m = compiled.matcher()
    return all(m.accept(t) for t in tokens) and m.is_terminated()


def check_output(sample: Sample, text: str) -> None:
    """The sample-specific check on the generated text (json: jsonschema; regex: fullmatch; choice: in list)."""
    import jsonschema

    if sample.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(sample.text))
    elif sample.kind == "regex":
        assert re.fullmatch(sample.text, text), (sample.text, text)
    elif sample.kind == "choice":
        assert text in json.loads(sample.text), text
    elif sample.kind == "structural_tag":
        for body in re.findall(r"<function=\w+>(.*?)</function>", text, re.S):
            json.loads(body)


def save_random_head(path: Path, cfg=None) -> Path:
    """An untrained draft head over a pruned vocabulary (every 3rd id: the d2t mask path), saved at
    `path`: hybrid / head drafting without a trained file. `cfg`: the target's ModelConfig
    (default: the default model's)."""
    from transformers import AutoConfig

    from specguide.models.llama import ModelConfig
    from specguide.models.loader import resolve_model_dir
    from specguide.speculative.draft_head import DraftHead

    if cfg is None:  # the config alone: no weights loaded, no CPU kernels built (GPU hosts)
        cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_dir()))
    torch.manual_seed(0)
    DraftHead(cfg, torch.arange(0, cfg.vocab_size, 3)).save(path, {"note": "random"})
    return path


def rambler(hf_tokenizer, vocab: int):
    """A 'model' that never closes a value: among the allowed tokens it takes the longest one
    without a quote or a closing bracket (string content, new keys, digits), else the first allowed."""
    texts = [hf_tokenizer.decode([t]) for t in range(len(hf_tokenizer))]
    order = sorted((t for t, s in enumerate(texts) if not any(c in s for c in '"}]')),
                   key=lambda t: -len(texts[t]))
    rest = set(range(vocab)) - set(order)
    order = np.array(order + sorted(rest), dtype=np.int64)

    def pick(mask: torch.Tensor) -> int:
        words = mask[0].numpy().view(np.uint32)
        allowed = (words[order >> 5] >> (order & 31).astype(np.uint32)) & 1
        return int(order[np.flatnonzero(allowed)[0]])
    return pick
