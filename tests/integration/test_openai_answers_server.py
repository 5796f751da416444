"""The OpenAI-compatible server's answers (specguide.openai_api) against the real stack, with the
official `openai` SDK: models and health, chat and completions whole and streamed, token-id
prompts, log probs, vLLM's extras, seeds and stop strings.

One OpenAI server process in front of the session's tritonserver (free ports, 127.0.0.1): the
`api` and `client` fixtures (conftest.py).
"""
from __future__ import annotations

import json
import re
import time
import urllib.request

import openai
import pytest

from .openai_helpers import MODEL, chat

# ------------------------------------------------------------------------------ basics


def test_models_and_health(api, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(api.base + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_the_start_up_heap_is_frozen_out_of_full_collections(api):
    """FastAPI, pydantic's schemas, the gRPC client: walked by no full collection while streams wait (heap.py)."""
    frozen = re.search(r"start-up heap frozen: (\d+) objects", api.log.read_text())
    assert frozen and int(frozen.group(1)) > 50000, api.log.read_text()[-2000:]


def test_chat_whole_and_streamed_agree_with_usage(client):
    whole = chat(client, messages=[{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}])
    c = whole.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("stop", "length")
    u = whole.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    chunks = list(chat(client, messages=[{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Name a color."}],
                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [c.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()
    assert all(ch.usage is None for ch in chunks[:-1])


def test_completions_prompts_n_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=6,
                                  n=2, temperature=0.8, seed=11, logprobs=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs)
        assert all(len(t) <= 3 for t in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    e = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True)
    assert e.choices[0].text.startswith("The capital of France is") and len(e.choices[0].text) > 24
    s = list(client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in s) == e.choices[0].text


def test_token_id_prompts(client):
    """`prompt` as token ids (one list, or a list of lists: what lm-eval's local-completions sends)
    answers as the same text does, echoed as the model's text of them; ids outside the vocabulary are
    the model's 400."""
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    want = [client.completions.create(prompt=p, **kw) for p in ("The capital of France is", "1, 2, 3,")]
    ids = [tok.encode(p) for p in ("The capital of France is", "1, 2, 3,")]
    one = client.completions.create(prompt=ids[0], **kw)
    assert one.choices[0].text == want[0].choices[0].text
    assert one.usage.prompt_tokens == want[0].usage.prompt_tokens == len(ids[0])
    both = client.completions.create(prompt=ids, **kw)
    assert [c.text for c in both.choices] == [w.choices[0].text for w in want]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(prompt=ids[1], stream=True, **kw))
    assert streamed == want[1].choices[0].text
    echoed = client.completions.create(prompt=ids[0], echo=True, **kw).choices[0].text
    assert echoed == "The capital of France is" + want[0].choices[0].text
    with pytest.raises(openai.BadRequestError, match="out of range"):
        client.completions.create(prompt=[1, 10**8], **kw)
    # logit_bias by token id: +100 all but forces a token at every position
    zebra = tok.encode(" zebra")[0]
    r = chat(client, max_tokens=4, logit_bias={str(zebra): 100})
    assert r.choices[0].message.content == " zebra" * 4


def test_vllm_extras_stop_token_ids_bad_words_and_continuous_usage(client):
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=10, temperature=0)
    base = client.completions.create(**kw).choices[0]
    comma = tok.encode(",")[0]
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [comma]}).choices[0]
    # vLLM's rule: a stop token that is not a special token stays in the text
    assert r.finish_reason == "stop" and r.text == base.text[:base.text.index(",") + 1]
    word = base.text.split(",")[1]  # " 6": the answer writes it; banned, it does not
    r = client.completions.create(**kw, extra_body={"bad_words": [word]}).choices[0]
    assert word + "," not in r.text and r.text != base.text
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 10 and all(ch.usage is not None for ch in chunks)


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """What lm-eval's loglikelihood requests send (token ids, echo, logprobs 1, max_tokens 1): every
    prompt token's log prob (null for the first) and top entry, then the generated one's; the same
    numbers streamed, and as the model's prompt_logprobs over Triton; text prompts alike."""
    from specguide.util.paths import cache_dir
    from specguide.tokenizer import TokenizerFile

    tok = TokenizerFile(cache_dir() / "models" / "smollm2-135m-instruct")
    text = "The capital of France is Paris"
    ids = tok.encode(text)
    kw = dict(model=MODEL, echo=True, logprobs=1, max_tokens=1, temperature=0)
    r = client.completions.create(prompt=ids, **kw).choices[0]
    lp = r.logprobs
    assert r.text.startswith(text) and len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs)
    assert "".join(lp.tokens) == r.text and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values())  # greedy: the generated token is the top one
    same = client.completions.create(prompt=text, **kw).choices[0].logprobs
    assert same.tokens == lp.tokens and same.token_logprobs == lp.token_logprobs
    streamed = list(client.completions.create(prompt=ids, stream=True, **kw))
    assert [v for ch in streamed if ch.choices and ch.choices[0].logprobs
            for v in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    # max_tokens 0 with echo scores the prompt alone (OpenAI's legacy API), whole or streamed
    for stream in (False, True):
        got = client.completions.create(prompt=ids, **{**kw, "max_tokens": 0}, stream=stream,
                                        **({"stream_options": {"include_usage": True}} if stream else {}))
        chunks = list(got) if stream else [got]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
        assert [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs] == lp.token_logprobs[:-1]
        assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    # vLLM's prompt_logprobs: per choice (completions), once per answer (chat); whole answers only
    v = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]["prompt_logprobs"]
    assert v[0] is None and len(v) == len(ids)
    assert [v[j][str(ids[j])]["logprob"] for j in range(1, len(ids))] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-5)
    assert all(2 <= len(e) <= 3 for e in v[1:])  # the token and the top 2
    c = chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0}).model_dump()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 0})
    assert e.value.body["param"] == "prompt_logprobs"
    # over Triton: specguide's prompt_logprobs output
    got = _grpc_stream_prompt_logprobs(server, text)
    assert [None] + [float(next(iter(e.values()))["logprob"]) for e in got[1:]] == \
        pytest.approx([None] + lp.token_logprobs[1:len(ids)], abs=1e-4)


def _grpc_stream_prompt_logprobs(server, text: str) -> list:
    import numpy as np
    import tritonclient.grpc as grpcclient

    results = []
    c = grpcclient.InferenceServerClient(server.grpc)
    c.start_stream(callback=lambda result, error: results.append((result, error)))
    try:
        inputs = []
        for name, value, dtype in (("text_input", [[text.encode()]], "BYTES"), ("stream", [[True]], "BOOL"),
                                   ("max_tokens", [[1]], "INT32"),
                                   ("sampling_parameters", [[json.dumps({"prompt_logprobs": 0, "temperature": 0}).encode()]],
                                    "BYTES")):
            arr = np.array(value, dtype=object if dtype == "BYTES" else (np.bool_ if dtype == "BOOL" else np.int32))
            t = grpcclient.InferInput(name, arr.shape, dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        c.async_stream_infer("specguide", inputs, outputs=[grpcclient.InferRequestedOutput("prompt_logprobs")],
                             enable_empty_final_response=True)
        deadline = time.monotonic() + 120
        while not any(r is not None and r.get_response().parameters["triton_final_response"].bool_param
                      for r, _ in results) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        c.stop_stream()
        c.close()
    assert all(e is None for _, e in results), results
    docs = [r.as_numpy("prompt_logprobs") for r, _ in results if r.as_numpy("prompt_logprobs") is not None]
    assert len(docs) == 1  # once
    return json.loads(docs[0].reshape(-1)[0])


def test_n_and_seeds(client):
    kw = dict(messages=[{"role": "user", "content": "Write a word."}], temperature=1.0, max_tokens=8)
    a, b = chat(client, seed=5, n=2, **kw), chat(client, seed=5, n=2, **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # reproducible
    # vLLM's min_p: 1 keeps only the likeliest token, so temperature 1 answers as greedy does
    kw["max_tokens"] = 16
    greedy = chat(client, **{**kw, "temperature": 0}).choices[0].message.content
    assert [c.message.content for c in chat(client, seed=5, n=2, extra_body={"min_p": 1.0}, **kw).choices] == [greedy] * 2


def test_stop_strings_are_cut(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0).choices[0].text
    word = base.strip().split(",")[1].strip()  # a number the model writes
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[word, "zzz"])
    assert r.choices[0].finish_reason == "stop" and word not in r.choices[0].text
    assert base.startswith(r.choices[0].text)


def test_logprobs_identical_with_speculation_on_and_off(client):
    kw = dict(messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=24, logprobs=True,
              top_logprobs=2, response_format={"type": "json_object"})
    on = chat(client, **kw).choices[0]
    off = chat(client, extra_body={"num_draft_tokens": 0}, **kw).choices[0]
    assert on.message.content == off.message.content
    assert [t.model_dump() for t in on.logprobs.content] == [t.model_dump() for t in off.logprobs.content]
    assert "".join(t.token for t in on.logprobs.content) == on.message.content
    assert all(len(t.top_logprobs) == 2 for t in on.logprobs.content)
