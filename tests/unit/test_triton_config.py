"""The `specguide` model's declared inputs and outputs agree with its config.pbtxt, the docs and the
client; config.pbtxt's parameters build an EngineConfig."""
from __future__ import annotations

import re
from pathlib import Path

from specguide.triton.interfaces import TRTLLM_INPUTS, TRTLLM_OUTPUTS

ROOT = Path(__file__).resolve().parents[2]


def _pbtxt_entries(section):
    text = (ROOT / "model_repository" / "specguide" / "config.pbtxt").read_text()
    body = re.search(section + r"\s*\[(.*?)\n\]", text, re.S).group(1)
    entries = {}
    for block in re.findall(r"\{(.*?)\}", body, re.S):
        name = re.search(r'name:\s*"([^"]+)"', block).group(1)
        dtype = re.search(r"data_type:\s*(\w+)", block).group(1)
        dims = tuple(int(d) for d in re.search(r"dims:\s*\[([^\]]*)\]", block).group(1).split(","))
        optional = re.search(r"optional:\s*true", block) is not None
        entries[name] = (dtype, dims, optional)
    return text, entries


def test_config_pbtxt_declares_exactly_the_io_specs():
    text, inputs = _pbtxt_entries("input")
    _, outputs = _pbtxt_entries("output")
    assert {k: v[:2] for k, v in inputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in TRTLLM_INPUTS}
    assert all(opt for _, _, opt in inputs.values()), "every input is optional"
    assert {k: v[:2] for k, v in outputs.items()} == {sp.name: (sp.dtype, sp.dims) for sp in TRTLLM_OUTPUTS}
    assert re.search(r"decoupled:\s*true", text)
    assert int(re.search(r"max_batch_size:\s*(\d+)", text).group(1)) > 0
    assert 'backend: "python"' in text


def test_config_pbtxt_parameters_build_an_engine_config():
    from specguide.config import EngineConfig

    text = (ROOT / "model_repository" / "specguide" / "config.pbtxt").read_text()
    params = {k: {"string_value": v} for k, v in
              re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}', text)}
    assert params, "config.pbtxt has engine parameters"
    cfg = EngineConfig.from_parameters(params)
    known = {f for f in EngineConfig.__dataclass_fields__}
    assert set(params) <= known, f"unknown parameters: {set(params) - known}"
    assert cfg.max_slots >= 1 or cfg.device == "auto"  # "auto": the engine sizes it (8 on CPU)


def test_the_interfaces_doc_documents_every_input_and_output():
    doc = (ROOT / "docs" / "interfaces.md").read_text()
    for sp in TRTLLM_INPUTS:
        assert f"`{sp.name}`" in doc, sp.name
    for sp in TRTLLM_OUTPUTS:
        assert f"`{sp.name}`" in doc, sp.name


def test_the_configuration_doc_lists_every_engine_setting():
    from specguide.config import EngineConfig

    doc = (ROOT / "docs" / "configuration.md").read_text()
    settings = doc[doc.index("## All settings"):]
    missing = [f for f in EngineConfig.__dataclass_fields__ if f"`{f}`" not in settings]
    assert not missing, f"docs/configuration.md's engine settings miss {missing}"


def test_client_sends_the_declared_dtypes():
    from client.common import INPUT_TYPES

    triton = {"TYPE_STRING": "BYTES"}
    assert set(INPUT_TYPES) == {sp.name for sp in TRTLLM_INPUTS if not sp.vllm_only}
    for sp in TRTLLM_INPUTS:
        if sp.vllm_only:
            continue
        assert INPUT_TYPES[sp.name][1] == triton.get(sp.dtype, sp.dtype[5:]), sp.name
