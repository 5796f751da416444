"""An OpenAI-compatible HTTP server in front of Triton: it holds no model.

Chat and text completions, structured outputs and tool calls, streamed or not, sent to the
`specguide` model over Triton's gRPC streaming API. Run it with `specguide-openai` or
`python -m specguide.openai_api` (see `cli.py`); `make serve` starts it beside tritonserver.
"""
