"""The request's one guide: `response_format`, vLLM's `guided_*` / `structured_outputs`, or tools.

Each becomes vLLM's `structured_outputs` dict, which the `specguide` model reads from
`sampling_parameters` with the same code as every other interface (`specguide.guided.params`);
that code also checks it here first, so a bad guide is a 400 naming its field before anything is
sent to Triton, with the message a Triton client would get.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from ..guided.params import from_vllm
from ..request import InvalidRequestError
from .errors import bad_request
from .schemas import (ChatCompletionRequest, CompletionRequest, NamedToolChoice, ResponseFormatJsonObject,
                      ResponseFormatJsonSchema, ToolChoiceMode)
from .tools import tool_guide


@dataclass
class Guide:
    """vLLM `structured_outputs` and the OpenAI field it came from."""

    structured_outputs: dict[str, Any]
    param: str


def _vllm_extras(req: Union[ChatCompletionRequest, CompletionRequest]) -> list[Guide]:
    found = []
    opts: dict[str, Any] = {}
    if req.guided_decoding_backend is not None:
        opts["backend"] = req.guided_decoding_backend
    if req.guided_whitespace_pattern is not None:
        opts["whitespace_pattern"] = req.guided_whitespace_pattern
    for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append(Guide({key: value, **opts}, field))
    if req.structured_outputs is not None:
        found.append(Guide(dict(req.structured_outputs), "structured_outputs"))
    if opts and not found:
        raise bad_request("guided_decoding_backend / guided_whitespace_pattern need a guided_* guide",
                          "guided_decoding_backend" if "backend" in opts else "guided_whitespace_pattern")
    return found


def _response_format(req: Union[ChatCompletionRequest, CompletionRequest]) -> Optional[Guide]:
    rf = req.response_format
    if isinstance(rf, ResponseFormatJsonObject):
        return Guide({"json_object": True}, "response_format")
    if isinstance(rf, ResponseFormatJsonSchema):
        if rf.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format.json_schema.schema")
        return Guide({"json": rf.json_schema.schema_, "strict": bool(rf.json_schema.strict)}, "response_format")
    return None  # text (or absent)


def check_tool_choice(req: ChatCompletionRequest) -> Union[ToolChoiceMode, NamedToolChoice]:
    """The effective tool_choice (OpenAI: `auto` with tools, else `none`), checked against `tools`."""
    choice = req.tool_choice
    if choice is None:
        return ToolChoiceMode.AUTO if req.tools else ToolChoiceMode.NONE
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools or []]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools", "tool_choice")
    elif choice != ToolChoiceMode.NONE and not req.tools:
        raise bad_request(f"tool_choice {choice.value!r} needs tools", "tool_choice")
    return choice


def resolve(req: Union[ChatCompletionRequest, CompletionRequest],
            tool_choice: Union[ToolChoiceMode, NamedToolChoice, None] = None) -> Optional[Guide]:
    """The one guide of a request (None: unconstrained); two guides at once are a 400."""
    found = _vllm_extras(req)
    rf = _response_format(req)
    if rf is not None:
        found.append(rf)
    if tool_choice is not None and tool_choice != ToolChoiceMode.NONE:
        parallel = getattr(req, "parallel_tool_calls", None) is not False
        found.append(Guide({"structural_tag": tool_guide(req.tools, tool_choice, parallel)}, "tool_choice"))
    if len(found) > 1:
        raise bad_request(f"give one guide: {found[0].param} and {found[1].param} both constrain the output "
                          "(with tools, use tool_choice 'none' to get a structured answer)", found[1].param)
    if not found:
        return None
    guide = found[0]
    try:
        from_vllm(guide.structured_outputs, guide.param)
    except InvalidRequestError as e:
        raise bad_request(str(e), guide.param) from None
    return guide
