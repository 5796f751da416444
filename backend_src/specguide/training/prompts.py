"""Prompt sets for training the draft head and for the speculative benchmarks, kept disjoint.

JSON-schema prompts come from the data shipped in `training/data` (package data, so a pip-installed
specguide and the Docker image have it too): JSONSchemaBench dev schemas (the benchmark subsets'
even-indexed files are held out for benchmarks; everything else may be trained on) and the
guided-decoding samples' JSON schemas. Chat prompts are plain instructions (two disjoint lists)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, Optional

from ..request import GuidedDecodingParams

BENCH_SUBSETS = ("Glaiveai2K", "Github_easy", "Kubernetes", "Snowplow")
MAX_SCHEMA_CHARS = 1500

CHAT_BENCH = [
    "Explain why the sky is blue.", "Write a short story about a robot learning to paint.",
    "Give me a recipe for pancakes.", "What are the benefits of regular exercise?",
    "Summarize the plot of Hamlet.", "Describe how a bicycle works.",
    "List five tips for better sleep.", "What is photosynthesis?",
]
CHAT_TRAIN = [
    "What causes the seasons on Earth?", "Write a poem about autumn leaves.",
    "How do I make a cup of green tea?", "Explain what a black hole is.",
    "Give three reasons to learn a second language.", "Describe the water cycle.",
    "What is the difference between a virus and a bacterium?", "Write a haiku about the ocean.",
    "How does a refrigerator keep food cold?", "Tell me a fun fact about octopuses.",
    "What are the main parts of a computer?", "Explain gravity to a child.",
    "Write a short letter thanking a teacher.", "How do plants drink water?",
    "List four healthy breakfast ideas.", "What is the tallest mountain in the world?",
    "Describe a sunny day at the beach.", "Why do cats purr?", "How do airplanes fly?",
    "Explain what a budget is and why it helps.", "Write a limerick about a frog.",
    "What is the capital of Japan and what is it known for?", "How do bees make honey?",
    "Give me tips for studying for an exam.", "What is machine learning?",
    "Describe the rules of chess briefly.", "Why is recycling important?",
    "Write a two-sentence horror story.", "How does the heart pump blood?",
    "What is the difference between weather and climate?", "Explain how a rainbow forms.",
    "Suggest a name for a pet turtle and explain why.", "What does a librarian do?",
    "How can I save energy at home?", "Describe the taste of a lemon.",
    "What is an atom made of?", "Write a short dialogue between a cat and a dog.",
    "How do you plant a tree?", "What are the colors of the rainbow?",
    "Explain what the internet is.", "Why do we dream?", "Describe your ideal weekend.",
    "What is the Pythagorean theorem?", "Give advice to someone starting a new job.",
    "How do volcanoes erupt?", "Write a product description for a reusable water bottle.",
    "What is democracy?", "Explain how to tie a shoelace.",
]


def data_dir() -> Path:
    """`$SPECGUIDE_DATA_DIR`, default the shipped `training/data` (jsonschemabench_dev, guided_samples)."""
    env = os.environ.get("SPECGUIDE_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parent / "data"


def schema_files(split: Literal["train", "heldout"]) -> list[Path]:
    """JSON-schema files of one split (sorted, deterministic)."""
    root = data_dir()
    bench = root / "jsonschemabench_dev"
    out: list[Path] = []
    for sub in sorted(p for p in bench.iterdir() if p.is_dir()) if bench.is_dir() else []:
        files = sorted(sub.glob("*.json"))
        for i, f in enumerate(files):
            held = sub.name in BENCH_SUBSETS and i % 2 == 0
            if held == (split == "heldout"):
                out.append(f)
    samples = root / "guided_samples"
    if split == "train" and samples.is_dir():
        manifest = json.loads((samples / "manifest.json").read_text())
        out += [samples / m["file"] for m in manifest
                if m["kind"] == "json_schema" and "unsupported" not in m["file"]]
    return out


SCHEMA_TEMPLATES = [  # the first is the benchmarks'; training uses all of them
    "Generate a JSON object that follows this JSON schema.\nSchema: {schema}",
    "Here is a JSON schema:\n{schema}\nWrite one realistic example instance of it as JSON.",
    "Fill in this JSON schema with plausible values and reply with the JSON only.\n{schema}",
    "Schema: {schema}\nProduce a valid JSON document for this schema.",
]


def schema_message(schema_text: str, variant: int = 0) -> str:
    return SCHEMA_TEMPLATES[variant].format(schema=schema_text)


def _compiles(compiler, text: str) -> bool:
    if compiler is None:
        return True
    try:
        compiler.compile(GuidedDecodingParams("json_schema", text))
        return True
    except Exception:
        return False


def _read(f: Path) -> Optional[object]:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError):
        return None


def load_schemas(split: Literal["train", "heldout"], compiler=None) -> list[str]:
    """Schema texts of a split, at most MAX_SCHEMA_CHARS each; with a GrammarCompilerService,
    only those that compile."""
    texts = [json.dumps(s) for s in map(_read, schema_files(split)) if s is not None]
    return [t for t in texts if len(t) <= MAX_SCHEMA_CHARS and _compiles(compiler, t)]


def _object_nodes(node: object, out: list[dict], top: bool = True) -> None:
    """Nested object schemas (two properties or more) of a schema, in document order."""
    if isinstance(node, dict):
        if not top and isinstance(node.get("properties"), dict) and len(node["properties"]) >= 2:
            out.append(node)
        for v in node.values():
            _object_nodes(v, out, False)
    elif isinstance(node, list):
        for v in node:
            _object_nodes(v, out, False)


def object_schemas(f: Path) -> list[str]:
    """The nested object schemas of a schema file as schema texts (type forced to object)."""
    nodes: list[dict] = []
    _object_nodes(_read(f), nodes)
    return [json.dumps({**n, "type": "object"}) for n in nodes]


def load_subschemas(compiler=None, per_file: int = 6, min_chars: int = 120) -> list[str]:
    """More training schemas: the self-contained nested object schemas (no `$ref`) of the train
    split's files, long ones included, at most `per_file` from each file, deduplicated against
    each other, the whole schemas, and every object schema inside a held-out file. Round-robin
    over files, so a prefix is varied."""
    seen = set(load_schemas("train")) | set(load_schemas("heldout"))
    seen |= {t for f in schema_files("heldout") for t in object_schemas(f)}
    per: list[list[str]] = []
    for f in schema_files("train"):
        mine: list[str] = []
        for text in object_schemas(f):
            if (len(mine) < per_file and min_chars <= len(text) <= MAX_SCHEMA_CHARS and '"$ref"' not in text
                    and text not in seen and _compiles(compiler, text)):
                seen.add(text)
                mine.append(text)
        per.append(mine)
    return [p[i] for i in range(per_file) for p in per if i < len(p)]
