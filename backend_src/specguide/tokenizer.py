"""Tokenizer wrapper and an incremental detokenizer that never splits a UTF-8 character."""
from __future__ import annotations

import threading
from pathlib import Path

REPLACEMENT = "\ufffd"


class Tokenizer:
    """Thread-safe wrapper over a Hugging Face fast tokenizer."""

    def __init__(self, folder: Path | str):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self._rust = self.hf.backend_tokenizer  # decode without transformers' Python around it (3.6x faster)
        self._lock = threading.Lock()  # NOTE: a Rust tokenizer object is not safe to share across threads
        eos = {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.vocab_size = len(self.hf)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        """`hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`: what the
        fast tokenizer's own decode gives (the detokenizer calls it twice per sequence per step)."""
        with self._lock:
            return self._rust.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        with self._lock:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


# strings whose ids a light tokenizer must reproduce before it replaces the full one (engine_process)
PROBES = ("Hello, world!", " leading space and  two", "Tab\there\nnew line\r\n", "naïve café 日本語 🙂",
          "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x ** 2  # comment", "3.14159 1e-10 $42",
          "{\"key\": [1, 2, {\"a\": null}]}", "UPPER lower MiXeD", "   ")


class TokenizerFile:
    """`encode` / `decode` from a folder's tokenizer.json with the `tokenizers` library alone: no
    transformers, no torch (~400 MB less where only text <-> ids is needed: the Triton stub).
    A transformers fast tokenizer is this object underneath; `matches` checks a model's ids agree."""

    def __init__(self, folder: Path | str):
        from tokenizers import Tokenizer as RustTokenizer

        self._tok = RustTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self._lock = threading.Lock()  # NOTE: as Tokenizer's
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        with self._lock:
            return self._tok.decode(list(ids), skip_special_tokens=True)

    def matches(self, reference: dict[str, tuple[list[int], str]]) -> bool:
        """Whether this gives the ids, and their text back, that another tokenizer gave (text -> (ids, text))."""
        return all(self.encode(t) == ids and self.decode(ids) == back for t, (ids, back) in reference.items())


def probe(tokenizer: "Tokenizer | TokenizerFile") -> dict[str, tuple[list[int], str]]:
    """`PROBES` through a tokenizer: text -> (ids, the ids decoded)."""
    return {t: (ids, tokenizer.decode(ids)) for t in PROBES for ids in [tokenizer.encode(t)]}


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Decodes a short window (`prefix_offset:`) instead of the whole output each time and holds
    back text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD). `finish()` returns
    whatever the full decode has beyond what was emitted, so the deltas always add up to it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.emitted = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset: self.read_offset])
        new_text = self.tok.decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.emitted += delta
        return delta

    def finish(self) -> str:
        """The rest of the text at the end of the sequence (including a trailing U+FFFD, if real)."""
        full = self.tok.decode(self.ids)
        assert full.startswith(self.emitted), "incremental decode diverged from the full decode"
        delta = full[len(self.emitted):]
        self.emitted = full
        return delta
