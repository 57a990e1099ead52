"""The chat rules shared by `LLM.chat` and the server's /v1/chat/completions, so the two cannot disagree.

A chat request becomes one engine request per choice: `chat_grammar` turns json_schema / json_object / a forced
tool choice into one llguidance grammar (behind a free thought channel when thinking is on), `chat_params` sets
what the Gemma 4 parser needs (special tokens kept) and the thinking budget, and `chat_finish_reason` says how a
finished generation is reported. Errors are `GrammarError` (a ValueError) naming the request field.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from gemmajax.engine.sampling_params import SamplingParams


def chat_grammar(*, json_schema: dict | str | None = None, json_object: bool = False,
                 tools: list[dict] | None = None, tool_choice: Any = "auto", parallel_tool_calls: bool = True,
                 thinking: bool = False) -> tuple[str | None, str | None]:
    """The grammar that constrains a chat answer, and the request field it came from (to name it in errors).

    Args:
      json_schema: the answer is JSON valid against this schema (response_format json_schema).
      json_object: the answer is any JSON object (response_format json_object).
      tools: OpenAI tool list; with tool_choice "required" or {"type": "function", "function": {"name": N}} (or the
        bare name N) the answer is one or more tool calls (exactly one when parallel_tool_calls is False).
      thinking: a free thought channel comes first; the constraint starts where it closes.
    Returns:
      (grammar, field) or (None, None) when nothing is constrained ("auto" / "none" tool choice, no format).
    Raises:
      GrammarError: a format together with a forced tool choice, or a schema / tool the grammar cannot express.
    """
    from gemmajax.tools import constrained

    named = _named_tool(tool_choice)
    forced = tool_choice == "required" or named is not None
    fmt = json_schema is not None or json_object
    if not forced and not fmt:
        return None, None
    if forced and fmt:
        raise constrained.GrammarError(
            f"response_format cannot be combined with tool_choice {tool_choice!r}: the output is either a tool "
            f"call or the format")
    if forced:
        mode = "named" if named is not None else "required"
        grammar = constrained.tool_call_grammar(list(tools or []), mode, named, parallel=parallel_tool_calls)
        param = "tools"
    elif json_schema is not None:
        grammar, param = constrained.json_schema_grammar(json_schema), "response_format"
    else:
        grammar, param = constrained.json_object_grammar(), "response_format"
    return (constrained.thinking_then(grammar) if thinking else grammar), param


def _named_tool(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    fn = getattr(tool_choice, "function", None)   # the server's NamedToolChoice
    if fn is not None:
        return fn.name
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        return tool_choice
    return None


def chat_params(p: SamplingParams, *, gemma4: bool, parse: bool, thinking: bool, grammar: str | None
                ) -> SamplingParams:
    """The engine's SamplingParams for one chat choice.

    parse: the output goes through the Gemma 4 parser (tools or thinking active), so special tokens stay in the
    text (`<|tool_call>`, `<|channel>`: vLLM #45832). A grammar replaces json_schema. With thinking on, a grammar
    and no thinking budget, the thought is closed once half of max_tokens is spent, so the constrained answer
    always gets room."""
    changes: dict[str, Any] = {}
    if gemma4 and parse:
        changes["skip_special_tokens"] = False
    if grammar is not None:
        changes["grammar"] = grammar
        changes["json_schema"] = None
        if thinking and p.thinking_token_budget is None:
            changes["thinking_token_budget"] = p.max_tokens // 2
    return dataclasses.replace(p, **changes) if changes else p


def chat_finish_reason(finish_reason: str | None, has_tool_calls: bool) -> str | None:
    """"tool_calls" when the answer holds complete tool calls, else the engine's reason. A generation cut by
    max_tokens stays "length" (its calls may be incomplete), an aborted one "abort"."""
    if has_tool_calls and finish_reason not in ("abort", "length", "error"):
        return "tool_calls"
    return finish_reason
