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


# ------------------------------------------------------------------------------------------------------------ media

DATA_URL = "data:"


def prepare_media(messages: list[dict], mm_cfg: Any, *, fetch: Any = None, limits: dict[str, int] | None = None,
                  max_soft_tokens: int = 280) -> tuple[list[dict], list]:
    """OpenAI content parts with media -> (messages for the chat template, processed media in prompt order).

    `{"type": "image_url", "image_url": {"url": ...}}` (a data URL; an http(s) URL only through `fetch(url) ->
    bytes`, the server's allow-listed fetcher) and `{"type": "input_audio", "input_audio": {"data": <base64>,
    "format": "wav"}}` are decoded and processed as HF's Gemma 4 processor does (gemmajax.tools.media); in the
    messages they become `{"type": "image"}` / `{"type": "audio"}` parts, which the template renders as the
    `<|image|>` / `<|audio|>` placeholders. Offline callers may also give `{"type": "image", "image": <bytes | path |
    PIL image>}`. limits: most images / audios per prompt, e.g. {"image": 4, "audio": 1}.

    Raises ValueError naming the part (messages.i.content.j) for a corrupt medium, an unknown format, a URL that
    cannot be read, a checkpoint without the tower, or more media than the limits allow."""
    from gemmajax.tools import media as md
    out, items, counts = [], [], {"image": 0, "audio": 0}
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind not in ("image_url", "image", "input_audio", "audio"):
                parts.append(part)
                continue
            media_kind = "image" if kind in ("image_url", "image") else "audio"
            tower = None if mm_cfg is None else (mm_cfg.vision if media_kind == "image" else mm_cfg.audio)
            if tower is None:
                raise ValueError(f"{where}: an {media_kind} input, but this checkpoint has no {media_kind} encoder "
                                 f"(a text-only model cannot see it)")
            counts[media_kind] += 1
            limit = (limits or {}).get(media_kind)
            if limit is not None and counts[media_kind] > limit:
                raise ValueError(f"{where}: more than {limit} {media_kind} input(s) in one prompt "
                                 f"(--limit-mm-per-prompt)")
            try:
                if media_kind == "image":
                    data = _image_source(part, fetch)
                    items.append(md.preprocess_image(data, max_soft_tokens, patch_size=tower.patch_size,
                                                     pooling_kernel_size=tower.pooling_kernel_size,
                                                     unified=mm_cfg.unified))
                else:
                    wave = md.decode_audio(_audio_bytes(part))
                    items.append(md.audio_features(wave, unified=mm_cfg.unified))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            parts.append({"type": media_kind})
        out.append({**msg, "content": parts})
    return out, items


def _image_source(part: dict, fetch: Any):
    if part.get("type") == "image":
        src = part.get("image", part.get("url"))
        if src is None:
            raise ValueError("an image part needs `image` (bytes, a path or a PIL image)")
        return src
    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str) or not url:
        raise ValueError("image_url.url must be a data URL or an http(s) URL")
    if url.startswith(DATA_URL):
        return _data_url_bytes(url)
    if url.startswith(("http://", "https://")):
        if fetch is None:
            raise ValueError(f"image_url {url[:80]!r}: fetching URLs is off; send the image as a data URL "
                             f"(the server fetches only from --allowed-media-domains)")
        return fetch(url)
    raise ValueError(f"image_url.url must be a data URL or an http(s) URL, got {url[:40]!r}")


def _data_url_bytes(url: str) -> bytes:
    import base64
    import binascii
    head, sep, body = url.partition(",")
    if not sep or ";base64" not in head:
        raise ValueError(f"a data URL must be data:<mime>;base64,<data>, got {url[:40]!r}")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the data URL's base64 does not decode ({e})") from None


def _audio_bytes(part: dict) -> bytes:
    import base64
    import binascii
    if part.get("type") == "audio":
        src = part.get("audio")
        if isinstance(src, (bytes, bytearray)):
            return bytes(src)
        if isinstance(src, str):
            with open(src, "rb") as f:
                return f.read()
        raise ValueError("an audio part needs `audio` (WAV bytes or a path)")
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise ValueError("input_audio needs {\"data\": <base64>, \"format\": \"wav\"}")
    fmt = spec.get("format", "wav")
    if fmt != "wav":
        raise ValueError(f"input_audio.format {fmt!r} is not supported; send WAV (format 'wav')")
    try:
        return base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"input_audio.data is not valid base64 ({e})") from None


def expand_media_prompt(text: str, items: list) -> str:
    """The rendered prompt with each `<|image|>` / `<|audio|>` placeholder expanded to its medium's soft tokens."""
    from gemmajax.tools.media import expand_prompt
    return expand_prompt(text, [m.num_soft_tokens for m in items if m.kind == "image"],
                         [m.num_soft_tokens for m in items if m.kind == "audio"])
