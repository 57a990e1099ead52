"""Pydantic models of the OpenAI-compatible HTTP API: requests in, responses and errors out.

Requests are validated field by field (pydantic's error locations become the `param` of a 400); unknown
fields are ignored and logged, as vLLM does. One `ChatMessage` model with role-specific checks, rather than a
union per role, keeps error locations short (`messages.1.content`, not `messages.1.user.content`).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class APIError(Exception):
    """A request failure to report to the client in OpenAI's error shape."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


INT32_MAX = 2**31 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------- chat messages
class ImageURL(_Request):
    url: str
    detail: str | None = None


class InputAudio(_Request):
    data: str
    format: str = "wav"


class ContentPart(_Request):
    """OpenAI content parts: text, image_url (a data URL, or http(s) where the server allows the domain) and
    input_audio (base64 WAV). Media are decoded by the chat serving (engine/chat.py prepare_media)."""

    type: Literal["text", "image_url", "input_audio"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None

    @model_validator(mode="after")
    def _fields(self) -> ContentPart:
        need = {"text": self.text, "image_url": self.image_url, "input_audio": self.input_audio}[self.type]
        if need is None:
            raise ValueError(f"a {self.type} content part needs `{self.type}`")
        return self

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> ChatMessage:
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs `content` (a string or a list of text parts), got null")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs `content` or `tool_calls`, got neither")
        if self.role != "assistant" and (self.tool_calls or self.reasoning_content is not None):
            raise ValueError(f"`tool_calls` and `reasoning_content` are only allowed on assistant messages, "
                             f"not on a {self.role} message")
        if self.role == "tool" and self.content is None:
            raise ValueError("a tool message needs `content` (the tool's result), got null")
        return self

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (vLLM's "string" content format)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    @property
    def has_media(self) -> bool:
        return isinstance(self.content, list) and any(p.type != "text" for p in self.content)


# --------------------------------------------------------------------------------------------- chat options
class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs `json_schema.schema`, got none")
        return self


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by chat and text completions (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # the sampler holds top_k in int32
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # SamplingParams' range
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    thinking_token_budget: int | None = Field(default=None, ge=0)   # vLLM's: the end of thought is forced after it
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def check(self) -> None:
        """Cross-field rules; raise APIError(400) naming the field."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "`stream_options` can only be set when `stream` is true", param="stream_options")

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @field_validator("chat_template_kwargs")
    @classmethod
    def _thinking_is_bool(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and "enable_thinking" in v and not isinstance(v["enable_thinking"], bool):
            raise ValueError(f"chat_template_kwargs.enable_thinking must be a boolean, "
                             f"got {type(v['enable_thinking']).__name__} {short_repr(v['enable_thinking'])}")
        return v

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, f"`top_logprobs` ({self.top_logprobs}) needs `logprobs: true`", param="top_logprobs")
        forced = isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required"
        if forced and not self.tools:
            raise APIError(400, f"tool_choice {self._tool_choice_str()} needs a non-empty `tools` list",
                           param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise APIError(400, f"tool_choice names function {short_repr(self.tool_choice.function.name)}, "
                                    f"which is not among the tools {short_repr(names, 200)}", param="tool_choice")

    def _tool_choice_str(self) -> str:
        tc = self.tool_choice
        return f"{{function: {tc.function.name}}}" if isinstance(tc, NamedToolChoice) else repr(tc)

    @property
    def enable_thinking(self) -> bool:
        return bool((self.chat_template_kwargs or {}).get("enable_thinking", False))

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    skip_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            for i, item in enumerate(v):
                if isinstance(item, list) and not item:
                    raise ValueError(f"prompt[{i}] is an empty token list")
                if isinstance(item, int) and item < 0 or isinstance(item, list) and any(t < 0 for t in item):
                    raise ValueError("token ids in prompt must be >= 0")
        return v

    def check(self) -> None:
        super().check()
        if self.suffix:
            raise APIError(400, f"`suffix` is not supported (got {self.suffix[:40]!r})", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of other than n is not supported (best_of={self.best_of}, n={self.n})",
                           param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# --------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "gemmajax"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# --------------------------------------------------------------------------------------------- validation
# pydantic puts union-member tags ("str", "list[int]", "function-after[...]", a model's class name such as
# "NamedToolChoice") into error locations; drop them. Every field name of the API is lower case.
_FIELD = re.compile(r"^[a-z_][A-Za-z0-9_]*$")
_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple", "literal", "json-or-python"}


def _clean_loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if isinstance(p, int) or (_FIELD.match(str(p)) and str(p) not in _TAGS)]
    return ".".join(parts).replace("schema_", "schema")


def parse_request(model_cls: type[BaseModel], body: Any) -> BaseModel:
    """Validate a decoded JSON body and its cross-field rules; raise APIError(400) naming the bad field(s)."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        request = model_cls.model_validate(body)
    except ValidationError as e:
        # loc -> (what each union member wanted, what was given). The deepest location first: for a union, the
        # member that got furthest says what is wrong; members that failed at the same place are all listed.
        seen: dict[str, tuple[list[str], str | None]] = {}
        for err in sorted(e.errors(include_url=False), key=lambda err: -len(_clean_loc(err["loc"]).split("."))):
            wants, got = seen.setdefault(_clean_loc(err["loc"]), ([], None))
            if err["type"] == "value_error":  # our own messages already say what they got
                want = err["msg"].removeprefix("Value error, ")
            else:
                want = err["msg"]
                if got is None:
                    seen[_clean_loc(err["loc"])] = (wants, short_repr(err.get("input")))
            if want not in wants:
                wants.append(want)
        parts = [f"{loc or 'body'}: {' / '.join(wants)}" + (f" (got {got})" if got is not None else "")
                 for loc, (wants, got) in list(seen.items())[:4]]
        first = next(iter(seen))
        raise APIError(400, "invalid request: " + "; ".join(parts), param=first or None) from None
    check = getattr(request, "check", None)
    if check is not None:
        check()
    return request


def short_repr(value: Any, limit: int = 80, quote: bool = True) -> str:
    """repr(value) (str(value) with quote=False) cut to `limit` characters, for echoing input in messages."""
    text = repr(value) if quote else str(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def unknown_fields(model_cls: type[BaseModel], body: dict[str, Any]) -> list[str]:
    """Top-level request fields that the model does not know (they are ignored and logged)."""
    known = set(model_cls.model_fields)
    known |= {f.alias for f in model_cls.model_fields.values() if f.alias}
    return sorted(k for k in body if k not in known)
