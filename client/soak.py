"""Soak load: many concurrent requests of every kind, each checked; a report of what happened.

    python -m client.soak --grpc localhost:8001 --http localhost:8000 --requests 300 --concurrency 16

The mix (seeded, so a run is repeatable): `bad_fraction` bad inputs (each must get one error),
`cancel_fraction` cancelled gRPC streams (cancelled after a random delay: queued, compiling,
prefilling or decoding), the rest good: guided (choice, regex, JSON schema) or not, streaming or
not, over gRPC streaming, HTTP generate or HTTP generate_stream, with num_draft_tokens 0, 1 or 3.
Every good request must end with a final response and no error; a guided one that ended by its
grammar (finish_reason "stop") must parse and validate.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from client.common import Chunk, GrpcStream, http_generate, http_generate_stream

PROMPTS = ["Tell me about the sea.", "Write a haiku about autumn.", "Name three colors.", "What is 2 + 2?",
           "Describe a cat.", "Give me a phone number.", "Is water wet?", "Count to five."]
# a cancelled stream's prompt: the model keeps counting to max_tokens (no EOS), so the cancel comes
# while the request runs however fast the server is (a short answer could finish before it): 1000
# tokens outlast the cancel's delay (at most 1 s) even where speculation on the counting writes ~600
# tokens/s to one stream (Zen 5: 200 tokens in 0.33 s)
CANCEL_TOKENS = 1000
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3,"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
PHONE = "[0-9]{3}-[0-9]{4}"
CHOICES = ["yes", "no", "maybe"]
GUIDES: list[tuple[str, str, Callable[[str], bool]]] = [
    ("choice", json.dumps(CHOICES), lambda t: t in CHOICES),
    ("regex", PHONE, lambda t: re.fullmatch(PHONE, t) is not None),
    ("json_schema", json.dumps(SCHEMA), lambda t: _valid_json(t)),
]
BAD: list[dict[str, Any]] = [
    {"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -1.0}, {"top_p": 1.5}, {"top_k": -2},
    {"num_draft_tokens": 99}, {"text_input": ""}, {"sampling_parameters": "{oops"},
    {"guided_decoding_guide_type": "regex", "guided_decoding_guide": "(ab"},
    {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": "{nope"},
    {"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": 'start ::= "a"'},
    {"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"},
]


def _valid_json(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:
        return False


@dataclass
class Plan:
    kind: str  # good | bad | cancel
    protocol: str  # grpc | http | http-stream
    values: dict[str, Any]
    guide: Optional[str] = None  # guide type of a good guided request
    cancel_after_s: float = 0.0


@dataclass
class Outcome:
    plan: Plan
    ok: bool
    problem: str = ""
    finish_reason: str = ""
    tokens: int = 0
    latency_s: float = 0.0


def make_plans(n: int, seed: int = 0, bad_fraction: float = 0.1, cancel_fraction: float = 0.1,
               guided_fraction: float = 0.4) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        values: dict[str, Any] = {"text_input": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 24),
                                  "num_draft_tokens": rng.choice([0, 1, 3]), "exclude_input_in_output": True}
        r = rng.random()
        if r < bad_fraction:
            plans.append(Plan("bad", rng.choice(["grpc", "http", "http-stream"]), {**values, **rng.choice(BAD)}))
        elif r < bad_fraction + cancel_fraction:
            values.update(stream=True, max_tokens=CANCEL_TOKENS, text_input=COUNTING)
            plans.append(Plan("cancel", "grpc", values, cancel_after_s=rng.uniform(0.0, 1.0)))
        else:
            guide = None
            if rng.random() < guided_fraction:
                guide, text, _ = rng.choice(GUIDES)
                values.update(guided_decoding_guide_type=guide, guided_decoding_guide=text, max_tokens=24)
            protocol = rng.choice(["grpc", "http", "http-stream"])
            values["stream"] = protocol == "http-stream" or (protocol == "grpc" and rng.random() < 0.5)
            plans.append(Plan("good", protocol, values, guide=guide))
    return plans


def _send(plan: Plan, grpc_url: str, http_url: str) -> list[Chunk]:
    if plan.protocol == "http":
        return [http_generate(plan.values, http_url, timeout=600)]
    if plan.protocol == "http-stream":
        return list(http_generate_stream(plan.values, http_url, timeout=600))
    s = GrpcStream(grpc_url)
    try:
        if plan.kind != "cancel":
            return list(s.generate(plan.values, timeout=600))
        def cancel() -> None:
            s.cancel()
            s._q.put((None, "cancelled by the client", time.perf_counter()))  # ends generate() below

        timer = threading.Timer(plan.cancel_after_s, cancel)
        timer.start()
        chunks = list(s.generate(plan.values, timeout=600))
        timer.cancel()
        return chunks
    finally:
        try:
            s.close()
        except Exception:
            pass


def run_one(plan: Plan, grpc_url: str, http_url: str) -> Outcome:
    t0 = time.perf_counter()
    try:
        chunks = _send(plan, grpc_url, http_url)
    except Exception as e:
        return Outcome(plan, plan.kind == "cancel", f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - t0)
    out = Outcome(plan, True, latency_s=time.perf_counter() - t0, tokens=sum(len(c.token_ids) for c in chunks))
    last = chunks[-1] if chunks else None
    if plan.kind == "cancel":
        return out  # cancelled or finished first: either is fine; the server's gauges must settle
    if last is None or not last.final:
        return _fail(out, "no final response")
    if plan.kind == "bad":
        return out if last.error is not None and len(chunks) == 1 else _fail(out, f"expected one error, got {chunks}")
    if last.error is not None:
        return _fail(out, f"error: {last.error}")
    if any(c.final for c in chunks[:-1]):
        return _fail(out, "a final flag before the last response")
    out.finish_reason = last.finish_reason
    if last.finish_reason not in ("stop", "length"):
        return _fail(out, f"finish_reason {last.finish_reason!r}")
    text = "".join(c.text for c in chunks)
    if plan.guide is not None and last.finish_reason == "stop":
        check = next(f for g, _, f in GUIDES if g == plan.guide)
        if not check(text):
            return _fail(out, f"{plan.guide} output does not validate: {text!r}")
    return out


def _fail(out: Outcome, problem: str) -> Outcome:
    out.ok, out.problem = False, problem
    return out


@dataclass
class Report:
    requests: int
    concurrency: int
    duration_s: float
    outcomes: list[Outcome] = field(repr=False, default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def summary(self) -> dict[str, Any]:
        kinds = Counter(o.plan.kind for o in self.outcomes)
        good = [o for o in self.outcomes if o.plan.kind == "good"]
        guided_stop = [o for o in good if o.plan.guide and o.finish_reason == "stop"]
        return {
            "requests": self.requests, "concurrency": self.concurrency, "duration_s": round(self.duration_s, 1),
            "kinds": dict(kinds), "protocols": dict(Counter(o.plan.protocol for o in self.outcomes)),
            "streaming": sum(bool(o.plan.values.get("stream")) for o in good),
            "guided": sum(bool(o.plan.guide) for o in good), "guided_stop_validated": len(guided_stop),
            "finish_reasons": dict(Counter(o.finish_reason for o in good)),
            "generated_tokens": sum(o.tokens for o in good),
            "failures": len(self.failures), "first_failures": [o.problem for o in self.failures[:5]],
        }


def run(plans: list[Plan], grpc_url: str, http_url: str, concurrency: int = 16) -> Report:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outcomes = list(pool.map(lambda p: run_one(p, grpc_url, http_url), plans))
    return Report(len(plans), concurrency, time.perf_counter() - t0, outcomes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc", default="localhost:8001")
    ap.add_argument("--http", default="localhost:8000")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    report = run(make_plans(args.requests, args.seed), args.grpc, args.http, args.concurrency)
    print(json.dumps(report.summary(), indent=2))


if __name__ == "__main__":
    main()
