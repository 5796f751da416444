"""Command-line client: stream tokens over gRPC as they arrive, or call HTTP generate / generate_stream.

    python -m client.cli "Write a haiku about GPUs" --max-tokens 48 --chat
    python -m client.cli --protocol http "The capital of France is" --max-tokens 8
    python -m client.cli --protocol http-stream --chat --guide-type json_schema --guide-file schema.json "..."
    echo "prompt from stdin" | python -m client.cli -

The text goes to stdout; with --stats, timings and counts go to stderr. Exit status 1 on an error response.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from client.common import MODEL, GrpcStream, chat_prompt, http_generate, http_generate_stream, load_chat_template


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client.cli", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text; '-' reads stdin (or give --input-ids)")
    p.add_argument("--protocol", choices=("grpc", "http", "http-stream"), default="grpc")
    p.add_argument("--url", help="host:port (default localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--no-stream", action="store_true", help="gRPC: ask for one response at the end")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--tokenizer", help="tokenizer folder for --chat (default: the default model's folder)")
    p.add_argument("--input-ids", help="comma-separated prompt token ids instead of text")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--bad-word", action="append", default=None, help="string never to generate (repeatable)")
    p.add_argument("--end-id", type=int)
    p.add_argument("--num-draft-tokens", type=int, help="draft tokens per step; 0 turns speculation off")
    p.add_argument("--include-input", action="store_true", help="echo the prompt in the output")
    p.add_argument("--guide-type", choices=("json", "json_schema", "regex", "ebnf_grammar", "structural_tag", "choice"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--guide-file", help="file holding the guide (schema, regex, grammar, tag, JSON list of choices)")
    g.add_argument("--guide", help="the guide itself")
    p.add_argument("--sampling-parameters", help="vLLM-style JSON, or @file")
    p.add_argument("--perf-metrics", action="store_true", help="ask for the draft-token counters")
    p.add_argument("--stats", action="store_true", help="print TTFT, token counts and timings to stderr")
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


def build_values(a: argparse.Namespace) -> dict:
    if a.input_ids:
        values = {"input_ids": [int(x) for x in a.input_ids.split(",") if x.strip()]}
    else:
        if a.prompt is None:
            sys.exit("give a prompt (or '-' for stdin, or --input-ids)")
        prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
        if a.chat:
            prompt = chat_prompt(load_chat_template(a.tokenizer), prompt, a.system)
        values = {"text_input": prompt}
    guide = a.guide
    if a.guide_file:
        guide = Path(a.guide_file).read_text()
    sampling = a.sampling_parameters
    if sampling and sampling.startswith("@"):
        sampling = Path(sampling[1:]).read_text()
    if sampling:
        json.loads(sampling)  # fail here, not on the server, on a typo
    streaming = a.protocol == "http-stream" or (a.protocol == "grpc" and not a.no_stream)
    values.update({
        "max_tokens": a.max_tokens, "min_tokens": a.min_tokens, "temperature": a.temperature, "top_k": a.top_k,
        "top_p": a.top_p, "seed": a.seed, "stop_words": a.stop, "bad_words": a.bad_word, "end_id": a.end_id,
        "num_draft_tokens": a.num_draft_tokens, "guided_decoding_guide_type": a.guide_type,
        "guided_decoding_guide": guide, "sampling_parameters": sampling,
        "stream": streaming, "exclude_input_in_output": not a.include_input,
        "return_num_input_tokens": True, "return_num_output_tokens": True,
        "return_perf_metrics": True if a.perf_metrics else None,
    })
    return {k: v for k, v in values.items() if v is not None}


def main(argv=None) -> int:
    a = parse_args(argv)
    values = build_values(a)
    t0 = time.perf_counter()
    if a.protocol == "grpc":
        stream = GrpcStream(a.url or "localhost:8001", a.model)
        chunks = stream.generate(values, timeout=a.timeout)
    elif a.protocol == "http-stream":
        chunks = http_generate_stream(values, a.url or "localhost:8000", a.model, timeout=a.timeout)
    else:
        chunks = iter([http_generate(values, a.url or "localhost:8000", a.model, timeout=a.timeout)])
    first_t, n_out, n_in, reason, perf, n_resp = None, 0, None, "", {}, 0
    try:
        for c in chunks:
            if c.error is not None:
                sys.stdout.write("\n")
                print(f"error: {c.error}", file=sys.stderr)
                return 1
            n_resp += 1
            if first_t is None and (c.text or c.token_ids):
                first_t = c.t
            sys.stdout.write(c.text)
            sys.stdout.flush()
            n_out += c.num_output_tokens if c.num_output_tokens is not None else len(c.token_ids)
            n_in = c.num_input_tokens if c.num_input_tokens is not None else n_in
            reason = c.finish_reason or reason
            perf = c.perf or perf
    except KeyboardInterrupt:
        if a.protocol == "grpc":
            stream.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    finally:
        if a.protocol == "grpc":
            stream.close()
    sys.stdout.write("\n")
    if a.stats:
        total = time.perf_counter() - t0
        ttft = f"{(first_t - t0) * 1e3:.1f} ms" if first_t is not None else "-"
        rate = f"{n_out / total:.1f}" if total > 0 else "-"
        print(f"finish_reason={reason} input_tokens={n_in} output_tokens={n_out} responses={n_resp} "
              f"ttft={ttft} total={total * 1e3:.1f} ms tokens/s={rate}"
              + "".join(f" {k}={v:g}" for k, v in perf.items()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
