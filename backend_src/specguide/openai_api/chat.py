"""Chat prompts: OpenAI messages rendered by the model's own chat template.

The template is rendered as transformers renders it (jinja2 sandbox, trim_blocks / lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, the special tokens' strings) without importing
transformers. Tools reach the prompt through the template's own `tools` support; a template
without it (the default model's) gets the generic format of `tools.py` in its system message, and
earlier tool calls and tool results are written into the messages in that same format.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import bad_request, unsupported
from .schemas import Message, OtherPart, Role, Tool
from .tools import call_text, tools_system_prompt


class ChatTemplate:
    """A model folder's chat template (`chat_template.jinja` or tokenizer_config.json's)."""

    def __init__(self, folder: Path):
        config = json.loads((folder / "tokenizer_config.json").read_text())
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text() if jinja.exists() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(f"{folder} has no chat template")
        self.source = template
        self.special = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
                        if k.endswith("_token") and isinstance(v, (str, dict))}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self._template = env.from_string(template)

    @property
    def supports_tools(self) -> bool:
        """The template renders a `tools` list itself (HF convention)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict]] = None,
               kwargs: Optional[dict[str, Any]] = None) -> str:
        """The prompt; `kwargs` are the request's chat_template_kwargs (e.g. Qwen3's enable_thinking)."""
        extra = {"tools": tools} if tools is not None else {}
        taken = set(kwargs or {}) & {"messages", "tools", "add_generation_prompt"}
        if taken:
            raise bad_request(f"chat_template_kwargs cannot set {sorted(taken)[0]!r} (the request's own field)",
                              "chat_template_kwargs")
        try:
            return self._template.render(**{**self.special, **(kwargs or {})}, messages=messages,
                                         add_generation_prompt=True, **extra)
        except Exception as e:  # the template's own raise_exception, or a message it cannot render
            raise bad_request(f"the chat template cannot render these messages: {e}", "messages") from None


def _raise(message: str) -> None:
    raise ValueError(message)


def render_chat(template: ChatTemplate, messages: list[Message], tools: Optional[list[Tool]],
                kwargs: Optional[dict[str, Any]] = None) -> str:
    """The prompt for a chat request; `tools` None = no tools in the prompt (none given, or tool_choice none)."""
    native = bool(tools) and template.supports_tools
    for i, m in enumerate(messages):
        _refuse_other_parts(i, m)
    out = [_message_dict(m, native) for m in messages]
    if tools and not native:  # the generic format, in the system message
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return template.render(out, [t.model_dump(exclude_none=True) for t in tools] if native else None, kwargs)


def _refuse_other_parts(i: int, m: Message) -> None:
    for j, part in enumerate(m.content if isinstance(m.content, list) else []):
        if isinstance(part, OtherPart):
            raise unsupported(f"messages[{i}].content[{j}].type", f"the model reads text only ('{part.type}' parts "
                              "are refused; send text parts or a string)")


def _message_dict(m: Message, native: bool) -> dict[str, Any]:
    role = Role.SYSTEM if m.role == Role.DEVELOPER else m.role
    if m.refusal is not None:
        raise bad_request("assistant messages with a refusal cannot be sent back", "messages")
    d: dict[str, Any] = {"role": role.value, "content": m.text()}
    if m.name:
        d["name"] = m.name
    if m.tool_calls:
        if role != Role.ASSISTANT:
            raise bad_request("only assistant messages carry tool_calls", "messages")
        if native:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                               for c in m.tool_calls]
        else:
            calls = "\n".join(call_text(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls)
            d["content"] = f"{d['content']}\n{calls}" if d["content"] else calls
    if role == Role.TOOL:
        if native:
            d["tool_call_id"] = m.tool_call_id
        else:
            d["content"] = f"<tool_response>\n{d['content']}\n</tool_response>"
    return d


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise bad_request(f"tool call arguments must be a JSON string, got {text[:80]!r}", "messages") from None
