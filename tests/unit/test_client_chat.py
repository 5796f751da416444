"""The CLI's --chat prompt without transformers (issue 37): the model folder's chat template rendered
as transformers renders it, and the CLI builds a chat request without importing transformers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from client.common import ChatTemplate, chat_prompt, load_chat_template, load_tokenizer
from specguide.models.loader import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("user", ["Write a haiku about GPUs.", 'Quote: "a\\nb" {{ not jinja }} <|im_end|>'])
def test_the_chat_template_renders_as_transformers_does(user, system):
    folder = resolve_model_dir()
    fast = load_chat_template(str(folder))
    assert isinstance(fast, ChatTemplate)
    assert chat_prompt(fast, user, system) == chat_prompt(load_tokenizer(str(folder)), user, system)


def test_a_folder_without_a_template_falls_back_to_the_tokenizer(tmp_path):
    import shutil

    folder = Path(shutil.copytree(resolve_model_dir(), tmp_path / "m", ignore=shutil.ignore_patterns("*.safetensors",
                                                                                                       "chat_template.jinja")))
    config = (folder / "tokenizer_config.json").read_text()
    import json

    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in json.loads(config).items()
                                                              if k != "chat_template"}))
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(folder)
    assert not isinstance(load_chat_template(str(folder)), ChatTemplate)


def test_the_cli_builds_a_chat_request_without_importing_transformers():
    code = ("import sys; from client.cli import parse_args, build_values; "
            "v = build_values(parse_args(['Name a color.', '--chat'])); "
            "print(v['text_input'].count('<|im_start|>'), 'transformers' in sys.modules, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["3", "False", "False"], p.stdout  # system, user, assistant turns
