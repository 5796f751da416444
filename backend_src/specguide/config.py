"""Engine configuration, parsed and validated from config.pbtxt `parameters`."""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping, Optional

CPU_SLOTS = 64  # max_slots 0 on CPU: sequences that run together (max_batch_size); KV blocks bound their memory
DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "q4_1", "q8_0")  # how the C kernels hold a weight
WEIGHT_DTYPES = WEIGHT_FORMATS + ("auto",)  # auto: each weight in the narrowest format that holds it exactly
ACTIVATION_DTYPES = ("auto", "float32", "int8")  # what block-format weights (q4_1, q8_0) multiply
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")  # what the CPU KV cache stores
DRAFTERS = ("ngram", "grammar", "head", "hybrid", "early_exit", "draft_model")
GUIDED_EXECUTORS = ("auto", "inline", "worker", "cuda")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning block's start and end markers (`<think>`, `</think>`): the guide applies after the end."""

    start: str
    end: str

    @classmethod
    def parse(cls, text: str) -> Optional["ReasoningMarkers"]:
        """'' -> None (off); '<think>,</think>' -> the markers; anything else -> ValueError saying why."""
        if not text.strip():
            return None
        parts = [p.strip() for p in text.split(",")]
        _check(len(parts) == 2 and all(parts),
               f"reasoning_markers must be '' (off) or '<start>,<end>' (e.g. '<think>,</think>'), got {text!r}")
        start, end = parts
        _check(end not in start, f"reasoning_markers: the end marker {end!r} must not occur in the start marker {start!r}")
        return cls(start, end)


@dataclass
class EngineConfig:
    """Every engine setting; the Triton adapter fills it from config.pbtxt parameters. The defaults are
    what the shipped model_repository/specguide/config.pbtxt serves, field for field (a unit test fails
    when they drift apart): an engine built with `EngineConfig()` runs what users run."""

    model_dir: str = ""  # HF folder (safetensors); "" = the embedded default model
    gguf_file: str = ""  # optional GGUF file inside model_dir (converted once, cached)
    dtype: str = "float32"
    weight_dtype: str = "auto"  # how linear weights are held on CPU (C kernels, dtype float32; fp32
    # activations and accumulation, batch-invariant): "float32"; "bfloat16", "int8" (per-output-channel
    # scales), "q4_1" (GGUF Q4_1 blocks of 32; the LM head Q8_0), "q8_0": weight-only quantization;
    # "auto": each weight in the narrowest of q4_1 / q8_0 / bfloat16 / float32 that holds it exactly
    # (the default GGUF model: Q4_1 layers and a Q8_0 head, the same logits as float32)
    activation_dtype: str = "auto"  # CPU, block-format weights (q4_1, q8_0: the default model's): "int8":
    # activations quantized per row and block of 32 (llama.cpp's q8), integer dot products (~2x faster
    # kernels, logits within ~0.5% of float32's; still batch-invariant); "float32": weights widened to
    # fp32, the float32 model's logits bit for bit; "auto": int8 where the kernel build has a vector
    # integer path (AVX2, AVX-512, VNNI), else float32
    kv_cache_dtype: str = "auto"  # CPU (C kernels), what the KV cache stores: "float16" halves the bytes a
    # decode step reads (attention at 8 streams and a few hundred positions reads more K/V than
    # weights; K/V rounded to fp16 once when written, every step reads the same values: still
    # batch-invariant); "int8": a quarter of fp32's bytes plus a scale per position and KV head (about
    # half of fp16's memory; faster decode at many streams, a long prompt's prefill about as fast,
    # logits further from float32's than fp16's: bench/bench_kv_cache.py; opt in for many slots at
    # long contexts); "float32": the float32 model's logits bit for bit; "auto": float16 with int8
    # activations (activation_dtype), else float32
    packed_weights_cache: bool = True  # CPU (C kernels): keep each checkpoint's packed weights (tiles, and
    # for auto / the block formats the quantized blocks) in the model cache ($SPECGUIDE_CACHE_DIR/packed,
    # one file per checkpoint and format): a load after the first reads them instead of packing
    # (~6 s of the default model's ~11.6 s start on 2 cores); false: pack at every load
    device: str = "auto"  # "cpu", "cuda", "auto" (CUDA when present, else CPU)
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = torch default
    gil_switch_interval_ms: float = 0.1  # the engine process's sys.setswitchinterval (Python's default is
    # 5 ms): every torch op and C kernel call releases the GIL, and while another Python thread is busy
    # the loop thread waits this long to take it back, after each (a CUDA grammar host function too).
    # With one busy thread beside it a step takes many times its own time at 5 ms, a few times at 0.1
    # (most where steps are short, on CUDA; bench/bench_gil_contention.py). Served, the engine process's
    # request reader waits for the GIL too: TTFT is longer at 5 ms; 0 = leave Python's default
    engine_nice: int = 5  # the engine process runs this much nicer than the server (os.nice): Triton's
    # front ends, the Python backend stubs and the OpenAI server (all light, latency-bound) then take a
    # core from the engine as soon as they wake instead of waiting their fair turn: served on 2 cores,
    # 5 against 0 gives as many tokens/s or more and a lower TTFT (bench/bench_openai.py measures both).
    # NOTE: a CPU-bound process in the server's own cgroup or session at nice 0 then gets 3x the
    # engine's share; 0 = the server's
    max_slots: int = 0  # sequences running together (rows of the KV block table); 0: 64 on CPU (set here for
    # device "cpu", by the engine for "auto"), on CUDA as many
    # as kv_cache_memory_fraction of the free memory (after the weights) holds at max_seq_len, at most 256 (logged)
    kv_cache_memory_fraction: float = 0.9  # the share of free memory for the KV blocks (CUDA: the GPU's after
    # the weights, CPU: MemAvailable; CPU pages are taken as blocks are first used), at most what every slot
    # at max_seq_len holds; fewer blocks than that: a sequence is preempted when they run out (the newest; first
    # the newest row of a request of many rows holding more than its share)
    kv_cache_bytes: int = 0  # bytes for the KV blocks instead of kv_cache_memory_fraction (0: the fraction)
    max_seq_len: int = 0  # prompt + generated tokens per sequence; 0: the model's context (config.json
    # max_position_embeddings, set by the engine), at most what the KV blocks hold
    prefill_chunk: int = 256  # prompt tokens per engine step (all prompts' chunks together)
    step_token_budget: int = 96  # CPU (the C kernels: prompt chunks and decode rows in one forward): tokens'
    # worth of work a step takes while sequences decode, their rows (each with its drafts) first, prompt
    # chunks the rest (at least a quarter); a token at position p is worth 1 + p x (a key's attention
    # work / a token's other work); smaller: running streams' tokens come evenly while a long prompt
    # prefills, larger: that prompt's first token sooner (bench_gap.py); 0: prefill_chunk
    new_request_slots: int = -1  # the last free slots, kept for requests none of whose rows holds a slot:
    # a request of many rows (a batch, n > 1) never takes them, so that one arriving after it starts at
    # once instead of waiting for those rows to finish; -1: max_slots // 8 (8 of the CPU's 64), 0: none
    prefix_caching: bool = True  # prefix sharing by block: every full KV block a sequence computed (prompt
    # and output positions) is keyed by its tokens and the one after it, and shared by every later
    # sequence that starts with them, while its owner runs and after (cached, least recently used taken
    # first when blocks run short); outputs as from scratch. Where the forward is chunk-invariant (CPU,
    # the C kernels) only: elsewhere off
    prefix_min_tokens: int = 1  # share only this many prompt tokens or more
    max_queue: int = 256  # waiting requests before new ones are refused
    default_max_tokens: int = 64  # when a request gives no max_tokens
    max_tokens_limit: int = 0  # 0 = max_seq_len
    warmup: bool = True  # run one forward at start so the first request is not slow
    request_timeout_s: float = 0.0  # default per-request time limit (queue + generation); 0 = none
    drain_timeout_s: float = 25.0  # unload: in-flight requests get this long to finish, then are cancelled
    engine_stall_s: float = 30.0  # watchdog: an engine process that, with requests in flight, turns its
    # loop no more (no step, no idle turn) or takes no request for this long is killed and restarted like
    # a crashed one (its requests end with UNAVAILABLE; counted in specguide_engine_restarts_total); 0 = off
    engine_start_timeout_s: float = 600.0  # an engine process not loaded and warmed up this long after it
    # started is killed (start-up, or a restart, fails); 0 = wait for it however long it takes
    num_draft_tokens: int = 3  # K: draft tokens verified per step (0 = no speculation); per request <= K
    drafter: str = "hybrid"  # "ngram" (prompt lookup) | "grammar" (grammar-forced jump-forward tokens,
    # then n-gram) | "head" (trained draft head) | "hybrid" (head + grammar-forced + trusted n-gram,
    # per slot per step) | "early_exit" (the target's first draft_layers) | "draft_model" (a separate
    # small model sharing the tokenizer, from draft_model_dir)
    draft_head_path: str = ""  # trained draft head (.pt) for "head"/"hybrid"; "" = the model cache's
    # (scripts/train_draft_head.py writes it; while missing, "head"/"hybrid" draft as "grammar" and the
    # engine attaches the file between steps once it is written)
    draft_head_training: str = "background"  # "background": a served engine whose head is missing has it
    # trained by a process of its own at the least CPU share (process/head_training.py); "off": it waits for
    # scripts/train_draft_head.py
    draft_head_weight_dtype: str = "q8_0"  # CPU (C kernels): how the draft head's linear weights are
    # held, as weight_dtype. Drafts never change the output, only acceptance: 8-bit drafts as well as
    # fp32 at less cost, and Q8_0 blocks take int8 activations in integer dot products where the target
    # does (bench/bench_speculative.py). "" = the target's weight_dtype (always so without the C kernels)
    adaptive_k: bool = True  # per-slot K from its recent acceptance (K stays <= num_draft_tokens)
    cost_aware_k: bool = True  # CPU: a step drafts only while the measured cost of its extra rows is
    # repaid by the expected accepted tokens (speculative/step_cost.py; while it is not, a probe step
    # drafts after 16 steps, then at doubling intervals up to 128, or only every 128 where even 0.2
    # more acceptance would not repay the step as measured; a new sequence's acceptance
    # estimate starts from its kind's, guided or not, and a slot's drifts back to it; grammar-forced
    # tokens and a recurring 4-gram's continuation count as sure drafts); decisions follow wall time, so
    # draft counts vary run to run (tokens never do): a test comparing draft counts turns it off.
    ngram_trust: int = 6  # hybrid: an n-gram chain replaces the head's drafts when its suffix match is this long
    draft_model_dir: str = ""  # HF folder of the draft model ("" = the default model)
    draft_layers: int = 16  # early-exit drafter depth
    ngram_max: int = 6  # longest suffix the n-gram drafter matches
    mask_drafts: bool = True  # apply grammar masks while drafting (off: only verification masks; ablation)
    sparse_lm_head: bool = True  # CPU (C kernels): a guided step's LM head computes only the output tiles
    # (64 token ids each) its rows' grammar masks allow, when that leaves out a quarter or more: the
    # same tokens and log probs (off: every tile, the ablation)
    spec_max_rows: int = 16  # rows one verification step may hold (batch x (K+1)): K shrinks as the
    # batch grows, since a CPU turns compute-bound past a few rows (0 = no limit; a GPU takes ~256)
    guided_compile_workers: int = 2  # grammar compile worker processes (guided/compile_pool.py)
    guided_backend: str = "auto"  # grammar backend of requests that name none: "auto" (JSON -> llguidance,
    # EBNF / structural tags / regex / choice -> xgrammar), "xgrammar", "llguidance" (alias "guidance")
    guided_undeclared_keys: str = "forbid"  # JSON Schema objects silent on additionalProperties: only their
    # declared keys ("forbid", as xgrammar strict mode / llama.cpp / OpenAI) or any key ("allow": the
    # spec's reading); a request's structured_outputs.undeclared_keys overrides it
    guided_cache_bytes: int = 512 * 1024 * 1024  # xgrammar compile cache limit
    guided_compile_timeout_s: float = 60.0  # 0 = no limit; a request past it fails with INVALID_ARG
    guided_max_guide_bytes: int = 262144  # a guide (schema / regex / grammar) larger is refused (0 = no limit)
    guided_max_schema_properties: int = 1000  # object properties in a schema, all levels (compile time
    # grows ~cubically with optional ones); 0 = no limit
    guided_max_nesting_depth: int = 64  # JSON nesting of a guide, and of sampling_parameters (+ 8); 0 = none
    guided_max_repetition: int = 65536  # largest {n,m} / maxLength / maxItems bound in a guide; 0 = none
    guided_max_expansion: int = 1048576  # what a guide expands to: the largest product of nested bounds
    # ({n,m} inside {n,m}, minItems x minItems x minLength, through $refs and rule references); 0 = none
    max_prompt_bytes: int = 0  # text_input larger is refused before tokenizing; 0 = 16 x max_seq_len
    max_sampling_parameters_bytes: int = 0  # sampling_parameters / request parameters JSON, and the
    # stop_words / bad_words tensors (each), larger are refused before parsing; 0 = guide limit + 64 KiB
    max_stop_strings: int = 64  # stop strings per request (vLLM / OpenAI `stop`): each is searched for
    # in the new text at every token; counted before any is read (0 = no limit)
    max_stop_token_ids: int = 256  # vLLM `stop_token_ids` per request (0 = no limit)
    max_stop_words: int = 256  # TensorRT-LLM stop words per request (`stop_words` and `stop_words_list`
    # together): each token sequence is compared with the output's end at every token; counted before
    # any is tokenized (0 = no limit)
    max_bad_words: int = 256  # bad words per request (`bad_words`, `bad_words_list`, vLLM `bad_words`),
    # as max_stop_words (0 = no limit)
    max_word_tokens: int = 8192  # token ids in a request's stop words and bad words together (0 = no limit)
    max_logits_bytes: int = 268435456  # a request's logits as float32 (`return_context_logits`: prompt x vocab;
    # `return_generation_logits`: max_tokens x vocab), larger is refused at intake (0 = no limit)
    guided_mask_threads: int = 1  # threads for the batched mask fill (1 is fastest on 2 cores)
    guided_executor: str = "auto"  # where the step's grammar callbacks run: "inline" (at once),
    # "worker" (a worker thread: the race test mode), "cuda" (host functions on a grammar
    # stream, captured in the step graphs); "auto" = "cuda" on a CUDA device, else "inline"
    cuda_graphs: bool = True  # on CUDA: one CUDA graph per speculative step and batch bucket
    lora_adapters: str = ""  # LoRA adapters (PEFT folders) served by name: a JSON object {"name": "folder"},
    # or the path of a file holding one (the vLLM backend's multi_lora.json); "" = none
    max_loras: int = 8  # adapters resident in memory at once (the least recently used idle one goes)
    lora_root: str = ""  # the folder adapters loaded at run time must be under (`/v1/load_lora_adapter`);
    # "" = `loras/` in the cache folder (~/.cache/specguide/loras); "off" = no loading at run time
    lora_cache_host_memory_bytes: int = 1073741824  # TensorRT-LLM LoRA tasks' weights (sent with `lora_weights`)
    # kept for later requests that name only their `lora_task_id`; past it the least recently used idle go
    lora_dtype: str = "auto"  # how adapters' weights are held: "auto" (bfloat16 where every value is one
    # already, else float32: the checkpoint's numbers), "float32", "bfloat16" (half the memory traffic),
    # "int8" (a scale per rank row; a quarter of float32's traffic, values within 1/254 of each row's largest)
    reasoning_markers: str = ""  # reasoning models: '<start>,<end>' (e.g. '<think>,</think>'); a guide then
    # applies only after the end marker (guided/reasoning.py); "" = off

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.weight_dtype in WEIGHT_DTYPES, f"weight_dtype must be one of {WEIGHT_DTYPES}, got {self.weight_dtype!r}")
        _check(self.activation_dtype in ACTIVATION_DTYPES,
               f"activation_dtype must be one of {ACTIVATION_DTYPES}, got {self.activation_dtype!r}")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES,
               f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check(self.draft_head_weight_dtype in ("",) + WEIGHT_DTYPES,
               f"draft_head_weight_dtype must be '' or one of {WEIGHT_DTYPES}, got {self.draft_head_weight_dtype!r}")
        _check(self.device in ("cpu", "cuda", "auto") or self.device.startswith("cuda:"),
               f"device must be cpu, cuda, cuda:<n> or auto, got {self.device!r}")
        _check(self.max_seq_len == 0 or self.max_seq_len >= 16, f"max_seq_len must be 0 or >= 16, got {self.max_seq_len!r}")
        for name, low in (("max_slots", 0), ("prefill_chunk", 1), ("step_token_budget", 0), ("max_queue", 1),
                          ("default_max_tokens", 1), ("draft_layers", 1), ("ngram_max", 1),
                          ("ngram_trust", 1), ("spec_max_rows", 0), ("guided_compile_workers", 1),
                          ("guided_mask_threads", 1), ("guided_compile_timeout_s", 0), ("request_timeout_s", 0),
                          ("drain_timeout_s", 0), ("guided_max_guide_bytes", 0), ("guided_max_schema_properties", 0),
                          ("engine_stall_s", 0), ("engine_start_timeout_s", 0),
                          ("guided_max_nesting_depth", 0), ("guided_max_repetition", 0), ("max_prompt_bytes", 0),
                          ("guided_max_expansion", 0),
                          ("max_sampling_parameters_bytes", 0), ("gil_switch_interval_ms", 0),
                          ("max_stop_strings", 0), ("max_stop_token_ids", 0), ("max_stop_words", 0),
                          ("max_bad_words", 0), ("max_word_tokens", 0), ("max_logits_bytes", 0),
                          ("engine_nice", 0), ("max_loras", 0),
                          ("lora_cache_host_memory_bytes", 0)):
            _check(getattr(self, name) >= low, f"{name} must be >= {low}, got {getattr(self, name)!r}")
        _check(self.new_request_slots >= -1, f"new_request_slots must be >= -1, got {self.new_request_slots}")
        _check(self.engine_nice <= 19, f"engine_nice must be in [0, 19], got {self.engine_nice}")
        _check(0 <= self.num_draft_tokens <= 15, f"num_draft_tokens must be in [0, 15], got {self.num_draft_tokens}")
        _check(self.drafter in DRAFTERS, f"unknown drafter {self.drafter!r} (one of {DRAFTERS})")
        _check(self.draft_head_training in ("background", "off"),
               f"draft_head_training must be 'background' or 'off', got {self.draft_head_training!r}")
        _check(self.guided_backend.strip().lower() in ("auto", "xgrammar", "llguidance", "guidance"),
               f"unknown guided_backend {self.guided_backend!r} (one of auto, xgrammar, llguidance)")
        _check(self.guided_undeclared_keys in ("forbid", "allow"),
               f"guided_undeclared_keys must be 'forbid' or 'allow', got {self.guided_undeclared_keys!r}")
        _check(self.lora_dtype in ("auto", "float32", "bfloat16", "int8"),
               f"lora_dtype must be auto, float32, bfloat16 or int8, got {self.lora_dtype!r}")
        _check(self.guided_executor in GUIDED_EXECUTORS,
               f"unknown guided_executor {self.guided_executor!r} (one of {GUIDED_EXECUTORS})")
        _check(self.kv_cache_bytes >= 0, f"kv_cache_bytes must be >= 0, got {self.kv_cache_bytes!r}")
        _check(0 < self.kv_cache_memory_fraction <= 1,
               f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction!r}")
        if self.max_slots == 0 and self.device == "cpu":  # "auto": the engine decides (this imports no torch)
            self.max_slots = CPU_SLOTS
        self.reasoning()  # ValueError for a bad reasoning_markers
        if self.max_sampling_parameters_bytes <= 0:
            self.max_sampling_parameters_bytes = (self.guided_max_guide_bytes or 1 << 20) + 65536
        if self.max_prompt_bytes <= 0:  # (0 while max_seq_len is: the engine's resolved config has them)
            self.max_prompt_bytes = 16 * self.max_seq_len
        if self.max_tokens_limit <= 0:
            self.max_tokens_limit = self.max_seq_len

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> "EngineConfig":
        """Build from `{key: value}` or Triton's `{key: {"string_value": value}}`. A key that is no
        setting is a ValueError naming the nearest one (a typo must not be ignored silently); upper
        case keys (EXECUTION_ENV_PATH, ...) belong to Triton and its Python backend."""
        known = [f.name for f in fields(cls)]
        for key in params:
            if key not in known and not key.isupper():
                near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"; did you mean {near[0]!r}?" if near else " (the settings: docs/configuration.md)"
                raise ValueError(f"unknown engine setting {key!r} in config.pbtxt{hint}")
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in params:
                continue
            raw = params[f.name]
            if isinstance(raw, Mapping):
                raw = raw.get("string_value", "")
            kwargs[f.name] = _coerce(f, raw)
        return cls(**kwargs)

    def reasoning(self) -> Optional[ReasoningMarkers]:
        """The reasoning block's markers; None when off."""
        return ReasoningMarkers.parse(self.reasoning_markers)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def lora_file(text: str, model_dir: Path, version: str) -> str:
    """config `lora_adapters` as a Triton model serves it: a relative file path is the model
    folder's; unset, the version folder's `multi_lora.json` when there is one (where the vLLM
    backend reads it)."""
    text = text.strip()
    if text.startswith("{"):
        return text
    if text:
        return str(model_dir / text) if not Path(text).is_absolute() else text
    found = model_dir / version / "multi_lora.json"
    return str(found) if found.is_file() else ""


def parse_adapters(text: str, base: Optional[Path] = None) -> dict[str, Path]:
    """config `lora_adapters`: '' (none), a JSON object {name: folder}, or the path of a file holding
    one (the vLLM backend's multi_lora.json); ValueError saying what is wrong. A relative folder is the
    working directory's, as vLLM reads it, or else the file's (`base`'s)."""
    text = text.strip()
    if not text:
        return {}
    where = "lora_adapters"
    if not text.startswith("{"):
        path = Path(text) if Path(text).is_absolute() or base is None else base / text
        try:
            text, base, where = path.read_text(), path.parent, str(path)
        except OSError as exc:
            raise ValueError(f"lora_adapters: cannot read {path} ({exc.strerror})") from None
    try:
        names = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(names, dict) or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                              for k, v in names.items()):
        raise ValueError(f"{where}: must be a JSON object of adapter names to folders")
    return {k: Path(v) if Path(v).is_absolute() or Path(v).exists() or base is None else base / v
            for k, v in names.items()}


def _coerce(f: dataclasses.Field, raw: Any) -> Any:
    typ = f.type if isinstance(f.type, str) else f.type.__name__
    if not isinstance(raw, str):
        return raw
    raw = raw.strip()
    if typ == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"parameter {f.name}: expected a boolean, got {raw!r}")
    if typ == "int":
        return int(raw)
    if typ == "float":
        return float(raw)
    return raw
