"""LoRA adapters through a real tritonserver, as a vLLM backend user serves them: `multi_lora.json`
in the model's version folder, `lora_name` in `sampling_parameters`. The vLLM backend's own client
script runs unchanged with `--lora-name`; greedy text with an adapter is peft's on transformers; a
name the server does not serve is a clear per-request error naming those it does. Adapters are
loaded and unloaded at run time through the OpenAI server (vLLM's endpoints) and the engine model's
control request, from under `lora_root` only."""
from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import MODEL, Server, launch, repository_with, stop_and_check
from .helpers import raw_stream
from .test_conformance import _http_post, _run
from ..lora_helpers import make_adapters, peft_greedy

# float32 weights and activations: the numbers transformers computes (peft's greedy tokens)
SETTINGS = {"weight_dtype": "float32", "activation_dtype": "float32", "draft_head_training": "off",
            "guided_compile_workers": "1"}
V = lambda text: np.array([text.encode()], dtype=np.object_)  # noqa: E731 (the vLLM backend's inputs: [1])
PROMPT = "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from specguide.models.loader import resolve_model_dir

    root = tmp_path_factory.mktemp("lora_server")
    folders, pm = make_adapters(resolve_model_dir(), root / "loras")
    repo = repository_with(root, {**SETTINGS, "lora_root": str(root / "loras")})  # run-time loads come from here
    (repo / MODEL / "1" / "multi_lora.json").write_text(json.dumps({k: str(v) for k, v in folders.items()}))
    srv = launch(root / "server.log", repo)
    yield srv, pm, folders
    stop_and_check(srv)


def _vllm_text(server: Server, sp: dict) -> tuple[str, str]:
    """A streamed greedy request to specguide_vllm: (its text, the final error's message or '')."""
    got = raw_stream(server, {"text_input": V(PROMPT), "stream": np.array([True]),
                              "sampling_parameters": V(json.dumps(sp))}, model="specguide_vllm")
    text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r, e, _ in got
                   if e is None and r.as_numpy("text_output") is not None and r.as_numpy("text_output").size)
    return text, next((e.message() for _, e, _ in got if e is not None), "")


def test_greedy_text_with_an_adapter_is_peft_s(served):
    from transformers import AutoTokenizer
    from specguide.models.loader import resolve_model_dir

    server, pm, _ = served
    tok = AutoTokenizer.from_pretrained(resolve_model_dir())
    ids = tok.encode(PROMPT)
    sp = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    for name in ("support", "legal", None):
        text, error = _vllm_text(server, {**sp, **({"lora_name": name} if name else {})})
        assert not error
        assert text == tok.decode(peft_greedy(pm, name, ids, 16), skip_special_tokens=True), name
    assert server.metric("specguide_lora_requests_total", adapter="legal") >= 1  # counted before the last response
    assert server.metric("specguide_lora_generation_tokens_total", adapter="support") >= 16
    assert server.wait_metric("specguide_lora_adapters_resident", 2) == 2  # both, from the start (max_loras 8)


def test_the_vllm_sample_client_runs_unchanged_with_lora_name(served, tmp_path):
    server, _, _ = served
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello, my name is\nThe most dangerous animal is\n")
    ok = _run(["vllm_client.py", "-m", "specguide_vllm", "-u", server.grpc, "--input-prompts", str(prompts),
               "--results-file", str(tmp_path / "ok.txt"), "--lora-name", "legal"])
    assert ok.returncode == 0 and "PASS: vLLM example" in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]
    bad = _run(["vllm_client.py", "-m", "specguide_vllm", "-u", server.grpc, "--input-prompts", str(prompts),
                "--results-file", str(tmp_path / "bad.txt"), "--lora-name", "nope"])
    assert "PASS: vLLM example" not in bad.stdout
    assert "LoRA adapter 'nope' is not loaded (adapters served: 'support', 'legal')" in bad.stdout, bad.stdout[-2000:]


def test_an_unknown_adapter_is_a_400_over_http_and_the_server_serves_on(served):
    server, _, _ = served
    status, body = _http_post(server, "specguide_vllm", {"text_input": PROMPT, "sampling_parameters": json.dumps(
        {"lora_name": "nope", "max_tokens": 4})})
    assert status == 400 and "'nope' is not loaded" in body, body
    status, body = _http_post(server, "specguide_vllm", {"text_input": PROMPT, "sampling_parameters": json.dumps(
        {"lora_name": "support", "max_tokens": 4})})
    assert status == 200 and json.loads(body)["text_output"], body


def test_the_openai_server_s_model_field_names_an_adapter(served, tmp_path):
    """OpenAI `model`: the served name or an adapter's (answered under that name, the vLLM
    interface's text for the same request); a name that is neither is 404 model_not_found."""
    import openai

    from .openai_helpers import Api

    server, _, _ = served
    api = Api(server.grpc, tmp_path / "api.log")
    try:
        api.wait_configured()
        client = api.client()
        r = client.completions.create(model="legal", prompt=PROMPT, max_tokens=16, temperature=0)
        assert r.model == "legal"
        text, error = _vllm_text(server, {"lora_name": "legal", "temperature": 0, "max_tokens": 16})
        assert not error and r.choices[0].text == text
        base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
        assert base.model == MODEL and base.choices[0].text != text
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert e.value.body["code"] == "model_not_found" and "'nope' is not loaded" in e.value.body["message"]
    finally:
        api.stop()
    assert "Traceback" not in api.log.read_text()


def test_the_tensorrt_llm_client_sends_lora_weights_once_then_the_task_id(served, tmp_path):
    """tensorrtllm_backend's inflight_batcher_llm_client.py unchanged: `--lora-path` (the .npy files
    hf_lora_convert.py writes, float16) with `--lora-task-id`, then the id alone: the same text, not
    the base model's; an id never sent is TensorRT-LLM's error."""
    import re

    import numpy as np

    from ..lora_helpers import trtllm_arrays
    from .test_conformance import _model_dir

    server, _, folders = served
    lora_dir = tmp_path / "legal-trtllm"
    lora_dir.mkdir()
    weights, config = trtllm_arrays(folders["legal"], np.float16)
    np.save(lora_dir / "model.lora_weights.npy", weights)
    np.save(lora_dir / "model.lora_config.npy", config)
    common = ["inflight_batcher_llm_client.py", "-u", server.grpc, "--text", PROMPT, "--request-output-len", "12",
              "--tokenizer-dir", _model_dir(), "--model-name", MODEL, "--streaming"]

    def text(*extra: str) -> str:
        p = _run(common + list(extra))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return re.search(r"Output beam 0: (.*)", p.stdout).group(1)

    first = text("--lora-path", str(lora_dir), "--lora-task-id", "5")
    assert text("--lora-task-id", "5") == first
    assert text() != first
    p = _run(common + ["--lora-task-id", "6"])
    assert "LoRA task 6 not found in cache. Please send LoRA weights with request" in p.stdout + p.stderr


def _post(api, path: str, body: dict) -> tuple[int, str]:
    status, data = api.post_raw(path, json.dumps(body).encode())
    return status, data.decode()


def test_adapters_load_and_unload_at_run_time_through_the_openai_server(served, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, bodies and answers: a folder under
    lora_root served under a new name gives that adapter's text; /v1/models lists it beside the
    adapters the model found in its multi_lora.json; a path outside the root, a name served already,
    the served model's name are 400s; unloading a name not served is a 404."""
    import openai

    from .openai_helpers import Api

    server, _, folders = served
    api = Api(server.grpc, tmp_path / "api.log")
    try:
        api.wait_configured()
        client = api.client()
        assert [m.id for m in client.models.list().data] == [MODEL, "support", "legal"]  # multi_lora.json's
        assert _post(api, "/v1/load_lora_adapter", {"lora_name": "sup2", "lora_path": "support"}) == \
            (200, "Success: LoRA adapter 'sup2' added successfully.")
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == [MODEL, "support", "legal", "sup2"] and cards["sup2"].parent == MODEL
        ask = dict(prompt=PROMPT, max_tokens=12, temperature=0)
        r = client.completions.create(model="sup2", **ask)
        assert r.model == "sup2" and r.choices[0].text == client.completions.create(model="support", **ask).choices[0].text
        for body, status, words in (
                ({"lora_name": "sup2", "lora_path": "legal"}, 400, "The lora adapter 'sup2' has already been loaded."),
                ({"lora_name": "x", "lora_path": str(folders["legal"].parent.parent)}, 400, "not under the adapter root"),
                ({"lora_name": "x", "lora_path": "../server.log"}, 400, "not under the adapter root"),
                ({"lora_name": MODEL, "lora_path": "legal"}, 400, "is the served model's name"),
                ({"lora_name": "x"}, 400, "Missing required parameter: 'lora_path'")):
            got = _post(api, "/v1/load_lora_adapter", body)
            assert got[0] == status and words in json.loads(got[1])["error"]["message"], (body, got)
        # in place: the name now serves legal's weights
        assert _post(api, "/v1/load_lora_adapter", {"lora_name": "sup2", "lora_path": "legal", "load_inplace": True})[0] == 200
        assert client.completions.create(model="sup2", **ask).choices[0].text == \
            client.completions.create(model="legal", **ask).choices[0].text
        assert _post(api, "/v1/unload_lora_adapter", {"lora_name": "sup2"}) == \
            (200, "Success: LoRA adapter 'sup2' removed successfully.")
        status, body = _post(api, "/v1/unload_lora_adapter", {"lora_name": "sup2"})
        assert status == 404 and json.loads(body)["error"]["message"] == "The lora adapter 'sup2' cannot be found."
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="sup2", **ask)
        assert e.value.body["code"] == "model_not_found"
        assert [m.id for m in client.models.list().data] == [MODEL, "support", "legal"]
    finally:
        api.stop()
    assert "Traceback" not in api.log.read_text()


def test_the_engine_model_s_control_request_loads_lists_and_unloads(served):
    """The control request the OpenAI server sends, as any Triton client sends it: the one input
    `specguide_lora` (JSON); the answer's `text_output` is JSON, an error INVALID_ARG or NOT_FOUND.
    specguide_unary takes it too (one answer); specguide_vllm refuses it."""
    import tritonclient.http as httpclient

    server, _, _ = served

    def control(body, model=MODEL) -> tuple[object, str]:
        text = body if isinstance(body, str) else json.dumps(body)
        got = raw_stream(server, {"specguide_lora": np.array([[text.encode()]], dtype=np.object_)}, model=model)
        result, error, _ = got[0]
        if error is not None:
            return None, error.message()
        return json.loads(result.as_numpy("text_output").reshape(-1)[0]), ""

    assert control({"action": "list"}) == ({"adapters": ["support", "legal"]}, "")
    answer, _ = control({"action": "load", "lora_name": "third", "lora_path": "legal"})
    assert answer["lora_name"] == "third" and answer["lora_path"].endswith("/loras/legal")
    assert control({"action": "list"})[0] == {"adapters": ["support", "legal", "third"]}
    text, error = _vllm_text(server, {"lora_name": "third", "temperature": 0, "max_tokens": 8})
    assert not error and text == _vllm_text(server, {"lora_name": "legal", "temperature": 0, "max_tokens": 8})[0]
    assert control({"action": "unload", "lora_name": "third"}) == ({"lora_name": "third"}, "")
    for body, words in (({"action": "unload", "lora_name": "third"}, "The lora adapter 'third' cannot be found."),
                        ({"action": "load", "lora_name": "y", "lora_path": "/etc"}, "not under the adapter root"),
                        ({"action": "drop"}, "action must be load, unload or list"),
                        ({"action": "list", "extra": 1}, "unknown key 'extra'"),
                        ("[1]", "must be a JSON object")):
        answer, error = control(body)
        assert answer is None and words in error, (body, error)
    assert control({"action": "list"})[0] == {"adapters": ["support", "legal"]}
    assert control({"action": "list"}, "specguide_vllm")[0] is None  # not an input of the vLLM interface
    http = httpclient.InferenceServerClient(server.http)
    lora = httpclient.InferInput("specguide_lora", [1, 1], "BYTES")
    lora.set_data_from_numpy(np.array([[json.dumps({"action": "list"}).encode()]], dtype=np.object_))
    unary = http.infer("specguide_unary", [lora])
    assert json.loads(unary.as_numpy("text_output").reshape(-1)[0]) == {"adapters": ["support", "legal"]}
