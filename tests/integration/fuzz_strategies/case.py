"""One hostile request (`Case`), the targets it goes to, and the served stack's limits the
strategies draw around (the default model's vocabulary, max_seq_len, the byte caps)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

VOCAB = 49152  # the default model's vocabulary (SmolLM2-135M-Instruct); ids at or past it are out of it
EOS = 2
PROMPT_BYTES_CAP = 32768  # max_prompt_bytes default (16 x max_seq_len)
GUIDE_BYTES_CAP = 262144  # guided_max_guide_bytes
JSON_BYTES_CAP = 327680  # max_sampling_parameters_bytes default
MAX_SEQ_LEN = 8192  # the served max_seq_len: the default model's whole context (max_position_embeddings)

ENGINE, UNARY, VLLM = "specguide", "specguide_unary", "specguide_vllm"
TARGETS = (ENGINE, UNARY, VLLM, "http", "openai_completions", "openai_chat")
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice")


@dataclass
class Case:
    """One hostile request. `target` is one of TARGETS; Triton targets carry `tensors` (name -> array,
    the array's dtype is the Triton type sent), HTTP / OpenAI ones `path` and a raw `body`."""

    target: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    path: str = ""
    body: bytes = b""
    request_id: str = ""
    stream: bool = False  # an OpenAI body's "stream" (read as SSE); HTTP: generate_stream

    def describe(self, limit: int = 600) -> str:
        """A short, printable description (long values cut) for reports."""
        if self.tensors:
            parts = []
            for name, arr in self.tensors.items():
                flat = np.asarray(arr).reshape(-1)
                head = [_short(v) for v in flat[:4]]
                more = f"+{flat.size - 4}" if flat.size > 4 else ""
                parts.append(f"{name}:{arr.dtype}{list(arr.shape)}={head}{more}")
            text = f"{self.target} id={_short(self.request_id, 24)} " + " ".join(parts)
        else:
            text = f"{self.target} {self.path} stream={self.stream} body={_short(self.body, limit)}"
        return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit})"


def _short(v: Any, n: int = 60) -> str:
    if isinstance(v, (bytes, bytearray)):
        r = repr(bytes(v[:n]))
        return r + (f"...({len(v)} bytes)" if len(v) > n else "")
    r = repr(v)
    return r if len(r) <= n else r[:n] + f"...({len(r)} chars)"
