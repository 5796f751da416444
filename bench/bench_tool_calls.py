"""Tool calls that end whole within max_tokens (issue 38): does every call of an answer parse and
validate against its function's schema, or is the last one cut?

    python bench/bench_tool_calls.py [--schemas 16] [--max-tokens 160] [--choices required,named]

The served engine (model_repository/specguide/config.pbtxt: the default model, its drafter and
every served setting) answers chat prompts offering one function whose parameters are a held-out
JSONSchemaBench object schema (never trained on), with the OpenAI server's tool guide (the
structural tag of `tool_choice` `required`, parallel calls allowed as OpenAI's default, or the named
function), in the generic tool format of a template without tools (the default model's), greedy,
one request after another. Per tool choice, the token budget on (served: guided/tag_completion.py)
and off (`complete_within_budget: false`), side by side in one run:
  * whole: the answer ended ("stop") and every call parses and validates (jsonschema, formats checked)
  * cut: the answer ran to max_tokens, its last call cut (arguments that do not parse)
  * refused: an error up front (max_tokens cannot hold the shortest call)
  * calls per answer, tokens, tokens/s (wall time)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "backend_src"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_json_quality import generate  # noqa: E402
from machine import cpu_header  # noqa: E402

from specguide.config import EngineConfig  # noqa: E402
from specguide.engine.loop import Engine  # noqa: E402
from specguide.guided.value_check import make_validator  # noqa: E402
from specguide.openai_api.schemas import NamedToolChoice, Tool, ToolChoiceMode  # noqa: E402
from specguide.openai_api.tools import parse_all, tool_guide, tools_system_prompt  # noqa: E402
from specguide.request import GuidedDecodingParams, Request, SamplingParams  # noqa: E402
from specguide.training.prompts import load_schemas  # noqa: E402
from specguide.triton.interfaces import engine_parameters  # noqa: E402


def tools_for(schemas: list[str]) -> list[Tool]:
    """One function per object schema: `submit`, its parameters the schema."""
    out = []
    for text in schemas:
        schema = json.loads(text)
        if isinstance(schema, dict) and schema.get("type") == "object":
            out.append(Tool.model_validate({"type": "function", "function": {
                "name": "submit", "description": "Submit one record", "parameters": schema}}))
    return out


def verdict(text: str, finish: str, schema: dict) -> tuple[str, int]:
    """('whole' | 'cut' | 'invalid', calls): every call parses and validates, the answer ended."""
    _, calls = parse_all(text)
    check = make_validator(schema)
    ok = 0
    for call in calls:
        try:
            ok += check.is_valid(json.loads(call.arguments))
        except ValueError:
            pass
    if calls and ok == len(calls) and finish == "stop":
        return "whole", len(calls)
    return ("cut" if finish == "length" else "invalid"), len(calls)


def run(engine: Engine, tools: list[Tool], choice: str, budget: bool, max_tokens: int) -> dict:
    rows = []
    for tool in tools:
        mode = NamedToolChoice.model_validate({"type": "function", "function": {"name": "submit"}}) \
            if choice == "named" else ToolChoiceMode(choice)
        tag = json.dumps(tool_guide([tool], mode, parallel=True))
        prompt = engine.tokenizer.apply_chat_template([
            {"role": "system", "content": tools_system_prompt([tool])},
            {"role": "user", "content": "Submit a record with realistic example values."}])
        req = Request(prompt=prompt, params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      guided=GuidedDecodingParams("structural_tag", tag, complete_within_budget=budget))
        toks, text, final, dt = generate(engine, req)
        if final.error:
            rows.append(dict(outcome="refused", calls=0, tokens=0, seconds=dt))
            continue
        outcome, calls = verdict(text, final.finish_reason, tool.function.parameters)
        rows.append(dict(outcome=outcome, calls=calls, tokens=len(toks), seconds=dt, text=text))
    n, toks, secs = len(rows), sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
    return dict(mode=f"{choice}, budget {'on' if budget else 'off'}", n=n,
                **{k: sum(r["outcome"] == k for r in rows) for k in ("whole", "cut", "invalid", "refused")},
                calls=round(sum(r["calls"] for r in rows) / n, 2), tokens=toks,
                tok_s=round(toks / secs, 1) if secs else None, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemas", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--choices", default="required,named")
    ap.add_argument("--json", help="write every answer here")
    args = ap.parse_args()
    print(cpu_header(), time.strftime("%Y-%m-%d"), flush=True)
    config = EngineConfig.from_parameters(engine_parameters(ROOT / "model_repository"))
    engine = Engine(config)
    results = []
    try:
        tools = tools_for(load_schemas("heldout", engine.core.compiler))[: args.schemas]
        print(f"engine: drafter {engine.core.drafter}, K={config.num_draft_tokens}; {len(tools)} held-out object "
              f"schemas as one function each, max_tokens {args.max_tokens}, greedy, batch 1\n")
        print("| tool_choice, budget | whole and valid | cut at max_tokens | ended invalid | refused | calls per answer "
              "| tokens | tok/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
        for choice in args.choices.split(","):
            for budget in (True, False):
                r = run(engine, tools, choice, budget, args.max_tokens)
                results.append(r)
                print(f"| {r['mode']} | {r['whole']}/{r['n']} | {r['cut']} | {r['invalid']} | {r['refused']} "
                      f"| {r['calls']} | {r['tokens']} | {r['tok_s']} |", flush=True)
    finally:
        engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
