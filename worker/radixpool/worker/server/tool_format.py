"""The tool-call syntax of the served model, chosen once at start-up: Hermes/Qwen `<tool_call>`
blocks, Llama 3.x bare `{"name": ..., "parameters": ...}` objects, or Mistral's
`[TOOL_CALLS][...]` array. The chat template says which one the model was trained on; the
`--tool-call-format` flag overrides it."""

from __future__ import annotations

from typing import Literal

ToolFormat = Literal["hermes", "llama3", "mistral"]
TOOL_FORMATS: tuple[ToolFormat, ...] = ("hermes", "llama3", "mistral")
TOOL_FORMAT_FLAGS = ("auto", *TOOL_FORMATS)
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA3_TAG = "<|python_tag|>"


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format a chat template teaches; Hermes when the template names none (the tiny
    models' template, and the safest guess for an unknown model)."""
    if not template or "<tool_call>" in template:
        return "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if LLAMA3_TAG in template or '"parameters"' in template:
        return "llama3"
    return "hermes"


def resolve_tool_format(flag: str, template: str | None) -> ToolFormat:
    """`--tool-call-format`: "auto" detects from the template, anything else is taken as is."""
    if flag == "auto":
        return detect_tool_format(template)
    if flag not in TOOL_FORMATS:
        raise ValueError(f"tool_call_format must be one of {', '.join(TOOL_FORMAT_FLAGS)}, "
                         f"got {flag!r}")
    return flag   # type: ignore[return-value]
