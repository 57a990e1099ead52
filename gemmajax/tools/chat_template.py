"""Chat templates: a checkpoint's own jinja template when it ships one, else a built-in Python renderer.

Design: the jinja path renders the way HF's `apply_chat_template` does (sandbox, trim/lstrip blocks, tojson,
raise_exception, strftime_now). The built-in Gemma 4 renderer follows the HF Gemma 4 template (reference
section 7.2) with the choices listed on `render_gemma4`; the Gemma 3 renderer is Gemma 3's HF template.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

Q = '<|"|>'  # Gemma 4's string delimiter in tool syntax
MODEL_SIZES = ("small", "large")  # small: E2B/E4B; large: 12B/26B-A4B/31B (empty thought in the prompt)
FAMILIES = ("gemma4", "gemma3")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render (bad role, order, content or tool call)."""


# ---------------------------------------------------------------------------------------------------
# Gemma 4 value syntax: {key:value,...} with strings in <|"|>
# ---------------------------------------------------------------------------------------------------

def _sorted_items(d: Mapping) -> list[tuple[Any, Any]]:
    """Items sorted by key ignoring case, like jinja's `dictsort` that the HF template uses."""
    return sorted(d.items(), key=lambda kv: kv[0].lower() if isinstance(kv[0], str) else kv[0])


def format_value(value: Any, quote_keys: bool = False) -> str:
    """A JSON-like value in Gemma 4 tool syntax: strings in <|"|>, numbers/true/false/null bare,
    objects `{key:value,...}` with keys sorted (quoted in <|"|> when `quote_keys`), arrays `[a,b]`."""
    if isinstance(value, str):
        return Q + value + Q
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "{" + ",".join((Q + str(k) + Q if quote_keys else str(k)) + ":" + format_value(v, quote_keys)
                              for k, v in _sorted_items(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v, quote_keys) for v in value) + "]"
    return str(value)


def _schema_type(schema: Mapping) -> tuple[str, bool]:
    """(upper-cased type, nullable-from-type-list): a JSON-schema type list like ["string", "null"]
    becomes STRING plus nullable."""
    t = schema.get("type")
    if isinstance(t, (list, tuple)):
        kinds = [str(x) for x in t if str(x).lower() != "null"]
        return (kinds[0].upper() if kinds else "NULL"), len(kinds) < len(t)
    return (str(t).upper() if t is not None else ""), False


def _format_properties(properties: Mapping) -> str:
    """`name:{description:..,type:..},...` for the properties of an object schema (keys sorted)."""
    out = []
    for name, schema in _sorted_items(properties):
        if not isinstance(schema, Mapping):
            raise ChatTemplateError(f"tool parameter {name!r}: schema must be an object, got {schema!r}")
        t, null_from_type = _schema_type(schema)
        fields = []
        if schema.get("description"):
            fields.append(f"description:{Q}{schema['description']}{Q}")
        if t == "STRING" and schema.get("enum"):
            fields.append("enum:" + format_value(list(schema["enum"]), quote_keys=True))
        elif t == "ARRAY" and isinstance(schema.get("items"), Mapping) and schema["items"]:
            items = []
            for key, val in _sorted_items(schema["items"]):
                if val is None:
                    continue
                if key == "properties":
                    items.append("properties:{" + (_format_properties(val) if isinstance(val, Mapping) else "") + "}")
                elif key == "required":
                    items.append("required:[" + ",".join(Q + str(r) + Q for r in val) + "]")
                elif key == "type":
                    up = val.upper() if isinstance(val, str) else [str(v).upper() for v in val]
                    items.append("type:" + format_value(up, quote_keys=True))
                else:
                    items.append(f"{key}:" + format_value(val, quote_keys=True))
            fields.append("items:{" + ",".join(items) + "}")
        if schema.get("nullable") or null_from_type:
            fields.append("nullable:true")
        if t == "OBJECT":
            if isinstance(schema.get("properties"), Mapping):
                fields.append("properties:{" + _format_properties(schema["properties"]) + "}")
            if schema.get("required"):
                fields.append("required:[" + ",".join(Q + str(r) + Q for r in schema["required"]) + "]")
        if t:
            fields.append(f"type:{Q}{t}{Q}")
        out.append(f"{name}:{{" + ",".join(fields) + "}")
    return ",".join(out)


def _tool_function(tool: Mapping) -> Mapping:
    """The function of an OpenAI tool ({"type": "function", "function": {...}}) or a bare function."""
    if "function" in tool:
        if tool.get("type", "function") != "function":
            raise ChatTemplateError(f"tool type {tool.get('type')!r} is not supported; expected 'function'")
        return tool["function"]
    if "name" in tool:
        return tool
    raise ChatTemplateError(f"tool {tool!r} has neither 'function' nor 'name'")


def format_tool_declaration(tool: Mapping) -> str:
    """`declaration:NAME{description:..,parameters:{properties:{..},required:[..],type:..}}`."""
    fn = _tool_function(tool)
    if not fn.get("name"):
        raise ChatTemplateError(f"tool function without a name: {fn!r}")
    out = f"declaration:{fn['name']}{{description:{Q}{fn.get('description') or ''}{Q}"
    params = fn.get("parameters")
    if params:
        fields = []
        if params.get("properties"):
            fields.append("properties:{" + _format_properties(params["properties"]) + "}")
        if params.get("required"):
            fields.append("required:[" + ",".join(Q + str(r) + Q for r in params["required"]) + "]")
        if params.get("type"):
            fields.append(f"type:{Q}{str(params['type']).upper()}{Q}")
        out += ",parameters:{" + ",".join(fields) + "}"
    if "response" in fn and isinstance(fn["response"], Mapping):
        resp = fn["response"]
        fields = []
        if resp.get("description"):
            fields.append(f"description:{Q}{resp['description']}{Q}")
        if resp.get("type"):
            fields.append(f"type:{Q}{str(resp['type']).upper()}{Q}")
        out += ",response:{" + ",".join(fields) + "}"
    return out + "}"


def format_tool_call(name: str, arguments: Any) -> str:
    """`<|tool_call>call:NAME{key:value,...}<tool_call|>`; arguments as a dict or a JSON object string."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, Mapping):
            raise ChatTemplateError(f"tool call {name!r}: arguments must be a JSON object, got {arguments!r}")
        arguments = parsed
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise ChatTemplateError(f"tool call {name!r}: arguments must be an object, got {type(arguments).__name__}")
    body = ",".join(f"{k}:{format_value(v)}" for k, v in _sorted_items(arguments))
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


def format_tool_response(name: str, response: Any) -> str:
    """`<|tool_response>response:NAME{key:value,...}<tool_response|>`; a string holding a JSON object counts
    as that object; any other value becomes `{value:...}`."""
    if isinstance(response, str):
        try:
            parsed = json.loads(response)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, Mapping):
            response = parsed
    if isinstance(response, Mapping):
        body = ",".join(f"{k}:{format_value(v)}" for k, v in _sorted_items(response))
    else:
        body = "value:" + format_value(response)
    return f"<|tool_response>response:{name}{{{body}}}<tool_response|>"


def strip_thinking(text: str) -> str:
    """Remove `<|channel>...<channel|>` blocks (an unclosed one runs to the end) and trim."""
    out = []
    for part in text.split("<channel|>"):
        out.append(part.split("<|channel>")[0])
    return "".join(out).strip()


# ---------------------------------------------------------------------------------------------------
# Built-in renderers
# ---------------------------------------------------------------------------------------------------

MEDIA_PLACEHOLDERS = {"image": "<|image|>", "audio": "<|audio|>"}


def _check_parts(messages: Sequence[Mapping]) -> None:
    """Only text parts and decoded media parts ({"type": "image"} / {"type": "audio"}, which render as their
    placeholder) reach a template. Raw image_url / input_audio parts (and any other kind) are refused, never
    dropped: a checkpoint's jinja template could otherwise render the conversation without the picture, the model
    answering as if none had been sent. LLM.chat and the server decode media first (engine/chat.py)."""
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, (list, tuple)):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                if kind != "text" and kind not in MEDIA_PLACEHOLDERS:
                    raise ChatTemplateError(f"messages.{i}.content.{j}: content part of type {kind!r} is not "
                                            f"supported here: decode media first (LLM.chat and the server do), "
                                            f"then pass text, image and audio parts")


def _text_of(content: Any, where: str, joiner: str = "") -> str:
    """Text of message content: a string, or a list of {"type": "text", "text": ...} parts (each trimmed) and
    decoded media parts, rendered as their `<|image|>` / `<|audio|>` placeholder (expanded later to the soft
    tokens: gemmajax.tools.media.expand_prompt)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in MEDIA_PLACEHOLDERS:
                texts.append(MEDIA_PLACEHOLDERS[kind])
            elif kind == "text":
                texts.append(str(part.get("text", "")).strip())
            else:
                raise ChatTemplateError(f"{where}: content part of type {kind!r} is not supported (text, image or "
                                        f"audio)")
        return joiner.join(texts)
    raise ChatTemplateError(f"{where}: content must be a string or a list of parts, got {type(content).__name__}")


def render_gemma4(messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None, enable_thinking: bool = False,
                  add_generation_prompt: bool = True, model_size: str = "small", bos_token: str = "<bos>") -> str:
    """Gemma 4 prompt (reference section 7.2). Where the HF template is ambiguous or odd, we choose:

    * `developer` is `system`; a system/developer first message opens the system turn, later ones get
      their own `<|turn>system` turn. A list of system text parts is joined with single spaces.
    * An assistant message renders: [thought] content tool_calls tool_responses. Its content goes *before*
      its tool calls (the order the model writes them; HF's template puts it after the responses).
    * A tool-calling assistant message is followed by the `tool` messages answering it (name resolved from
      `tool_call_id`, else the message's `name`); the model turn then stays open, and the next assistant
      message continues it without a new `<|turn>model`. With no responses yet the render ends in
      `<|tool_response>` (what the model emits before the runtime answers). A turn left open is closed with
      `<turn|>\\n` before a user/system turn. A `tool` message anywhere else is an error.
    * Tool call arguments: a dict or a JSON-object string (parsed; anything else is an error). A tool
      response that is a string holding a JSON object is rendered as that object (`key:value`), otherwise as
      `{value:<|"|>...<|"|>}`; `null` renders as `null`.
    * Thinking: earlier assistant text loses its `<|channel>...<channel|>`; `reasoning_content` (or
      `reasoning`) of tool-calling assistant messages after the last user message is re-emitted as
      `<|channel>thought\\n...\\n<channel|>`.
    * Generation prompt `<|turn>model\\n`, plus `<|channel>thought\\n<channel|>` for large models with thinking
      off; none while a model turn is open (after a tool call or response).
    """
    if model_size not in MODEL_SIZES:
        raise ChatTemplateError(f"model_size must be one of {MODEL_SIZES}, got {model_size!r}")
    msgs = list(messages)
    out = [bos_token]
    first_role = msgs[0].get("role") if msgs else None
    if enable_thinking or tools or first_role in ("system", "developer"):
        out.append("<|turn>system\n")
        if enable_thinking:
            out.append("<|think|>\n")
        if first_role in ("system", "developer"):
            out.append(_text_of(msgs[0].get("content"), "message 0", joiner=" "))
            msgs = msgs[1:]
            offset = 1
        else:
            offset = 0
        for tool in tools or ():
            out.append("<|tool>" + format_tool_declaration(tool) + "<tool|>")
        out.append("<turn|>\n")
    else:
        offset = 0
    last_user = max((k for k, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
    turn_open = False  # a model turn left open by tool calls / responses
    consumed: set[int] = set()  # tool messages already rendered after their assistant message
    for k, msg in enumerate(msgs):
        where = f"message {k + offset}"
        role = msg.get("role")
        if role == "tool":
            if k not in consumed:
                raise ChatTemplateError(f"{where}: a 'tool' message must follow an assistant message with tool_calls")
            continue
        if role in ("user", "system", "developer"):
            if turn_open:
                out.append("<turn|>\n")
                turn_open = False
            turn_role = "system" if role == "developer" else role
            out.append(f"<|turn>{turn_role}\n" + _text_of(msg.get("content"), where) + "<turn|>\n")
            continue
        if role != "assistant":
            raise ChatTemplateError(f"{where}: unknown role {role!r} (expected system, developer, user, assistant, tool)")
        if not turn_open:
            out.append("<|turn>model\n")
        tool_calls = msg.get("tool_calls") or []
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if reasoning and tool_calls and k > last_user:
            out.append(f"<|channel>thought\n{reasoning}\n<channel|>")
        content = msg.get("content")
        if isinstance(content, str):
            out.append(strip_thinking(content))
        elif content is not None:
            out.append(strip_thinking(_text_of(content, where)))
        names = {}
        for call in tool_calls:
            fn = call.get("function", call)
            if not fn.get("name"):
                raise ChatTemplateError(f"{where}: tool call without a function name: {call!r}")
            names[call.get("id")] = fn["name"]
            out.append(format_tool_call(fn["name"], fn.get("arguments")))
        responses = []
        for resp in msg.get("tool_responses") or ():  # Gemma-native: responses on the assistant message
            responses.append(format_tool_response(resp.get("name") or "unknown", resp.get("response")))
        if tool_calls and not responses:
            j = k + 1
            while j < len(msgs) and msgs[j].get("role") == "tool":
                follow = msgs[j]
                name = names.get(follow.get("tool_call_id")) if follow.get("tool_call_id") is not None else None
                name = name or follow.get("name") or "unknown"
                body = follow.get("content")
                if isinstance(body, Sequence) and not isinstance(body, str):
                    body = _text_of(body, f"message {j + offset}")
                responses.append(format_tool_response(name, body))
                consumed.add(j)
                j += 1
        out.extend(responses)
        if responses:
            turn_open = True
        elif tool_calls:
            out.append("<|tool_response>")
            turn_open = True
        else:
            out.append("<turn|>\n")
            turn_open = False
    if add_generation_prompt and not turn_open:
        out.append("<|turn>model\n")
        if model_size == "large" and not enable_thinking:
            out.append("<|channel>thought\n<channel|>")
    return "".join(out)


def render_gemma3(messages: Sequence[Mapping], add_generation_prompt: bool = True, bos_token: str = "<bos>",
                  tools: Sequence[Mapping] | None = None) -> str:
    """Gemma 3 prompt (its HF template): the system prompt is folded into the first user turn,
    roles must alternate user/assistant, assistant is `model`, content trimmed."""
    if tools:
        raise ChatTemplateError("Gemma 3 has no tool-calling format in its chat template; tools are not supported")
    msgs = list(messages)
    prefix = ""
    if msgs and msgs[0].get("role") in ("system", "developer"):
        content = msgs[0].get("content")
        if isinstance(content, str):
            prefix = content + "\n\n"
        else:  # as Gemma 3's template: the first part's text, untrimmed
            prefix = str(content[0].get("text", "")) + "\n\n"
        msgs = msgs[1:]
    out = [bos_token]
    for k, msg in enumerate(msgs):
        role = msg.get("role")
        expected = "user" if k % 2 == 0 else "assistant"
        if role != expected:
            raise ChatTemplateError(f"Gemma 3: conversation roles must alternate user/assistant/user/...; message "
                                    f"{k + (len(messages) - len(msgs))} has role {role!r}, expected {expected!r}")
        out.append("<start_of_turn>" + ("model" if role == "assistant" else role) + "\n" + (prefix if k == 0 else ""))
        out.append(_text_of(msg.get("content"), f"message {k}") + "<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------
# Jinja templates (a checkpoint's chat_template), rendered like HF's apply_chat_template
# ---------------------------------------------------------------------------------------------------

class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_jinja(template: str) -> jinja2.Template:
    """Compile a chat template in the sandbox HF uses, with HF's helpers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# ---------------------------------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------------------------------

class ChatTemplate:
    """A conversation renderer: a jinja template (a checkpoint's own) or the built-in one of `family`.

    Args:
      family: "gemma4" or "gemma3" (`Tokenizer.family`).
      model_size: "small" (E2B/E4B) or "large" (12B/26B-A4B/31B); only the built-in Gemma 4 renderer uses it.
      template: jinja source; None for the built-in renderer.
    """

    def __init__(self, family: str = "gemma4", model_size: str = "small", template: str | None = None,
                 bos_token: str = "<bos>", eos_token: str = "<eos>", source: str | None = None):
        if family not in FAMILIES:
            raise ChatTemplateError(f"family must be one of {FAMILIES}, got {family!r}")
        if model_size not in MODEL_SIZES:
            raise ChatTemplateError(f"model_size must be one of {MODEL_SIZES}, got {model_size!r}")
        self.family, self.model_size = family, model_size
        self.template = template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.source = source or ("jinja" if template is not None else f"built-in {family}")
        self._compiled = compile_jinja(template) if template is not None else None

    @property
    def is_builtin(self) -> bool:
        return self._compiled is None

    def render(self, messages: Sequence[Mapping], tools: Sequence[Mapping] | None = None,
               enable_thinking: bool = False, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI-style dicts), starting with the BOS token."""
        if not messages:
            raise ChatTemplateError("messages is empty")
        _check_parts(messages)
        if self._compiled is not None:
            try:
                return self._compiled.render(
                    messages=list(messages), tools=list(tools) if tools else None,
                    add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                    bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
            except jinja2.exceptions.TemplateError as e:
                raise ChatTemplateError(f"chat template ({self.source}) failed: {e}") from e
        if self.family == "gemma3":
            return render_gemma3(messages, add_generation_prompt, self.bos_token, tools)
        return render_gemma4(messages, tools, enable_thinking, add_generation_prompt, self.model_size, self.bos_token)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike | None, family: str = "gemma4",
                        model_size: str = "small") -> ChatTemplate:
        """The checkpoint's template: `chat_template.jinja`, else `chat_template` of tokenizer_config.json,
        else (for a .gguf) its `tokenizer.chat_template`; the built-in renderer when there is none."""
        if path is None:
            return cls(family, model_size)
        path = Path(path)
        bos, eos = "<bos>", "<eos>"
        if path.is_file() and path.suffix == ".gguf":
            from gemmajax.tools.tokenizer import read_gguf_metadata

            meta = read_gguf_metadata(path)
            template = meta.get("tokenizer.chat_template")
            tokens = meta.get("tokenizer.ggml.tokens") or []

            def token(key: str, default: str) -> str:
                tid = meta.get(f"tokenizer.ggml.{key}_token_id")
                return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else default

            return cls(family, model_size, template, token("bos", bos), token("eos", eos),
                       source=f"{path} (GGUF metadata)" if template else None)
        ckpt_dir = path if path.is_dir() else path.parent
        cfg: dict[str, Any] = {}
        if (ckpt_dir / "tokenizer_config.json").is_file():
            with open(ckpt_dir / "tokenizer_config.json", encoding="utf-8") as fh:
                cfg = json.load(fh)
            bos, eos = _token_text(cfg.get("bos_token"), bos), _token_text(cfg.get("eos_token"), eos)
        if (ckpt_dir / "chat_template.jinja").is_file():
            template = (ckpt_dir / "chat_template.jinja").read_text(encoding="utf-8")
            return cls(family, model_size, template, bos, eos, source=str(ckpt_dir / "chat_template.jinja"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: HF picks "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if isinstance(template, str):
            return cls(family, model_size, template, bos, eos, source=str(ckpt_dir / "tokenizer_config.json"))
        return cls(family, model_size, bos_token=bos, eos_token=eos)


def _token_text(tok: Any, default: str) -> str:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, Mapping) and isinstance(tok.get("content"), str):
        return tok["content"]
    return default


def render_chat(messages: Sequence[Mapping], *, family: str = "gemma4", tools: Sequence[Mapping] | None = None,
                enable_thinking: bool = False, add_generation_prompt: bool = True, model_size: str = "small",
                chat_template: str | None = None, bos_token: str = "<bos>", eos_token: str = "<eos>",
                **kwargs: Any) -> str:
    """Render a conversation to prompt text (starting with `<bos>`; encode it with add_bos=False).

    Args:
      messages: OpenAI-style dicts: role (system/developer/user/assistant/tool), content (str or text parts),
        assistant `tool_calls` / `reasoning_content`, tool `tool_call_id` / `name`.
      family: "gemma4" or "gemma3" (`Tokenizer.family`), for the built-in renderer.
      chat_template: jinja source to use instead of the built-in renderer (extra kwargs go to it).
    """
    tpl = ChatTemplate(family, model_size, chat_template, bos_token, eos_token)
    return tpl.render(messages, tools=tools, enable_thinking=enable_thinking,
                      add_generation_prompt=add_generation_prompt, **kwargs)

