"""The OpenAI API schema as pydantic models: requests (the parse step of the request path) and the response objects
the format step fills.

Requests are strict (a string where a number belongs is a 400, not converted); fields not declared are ignored.
A few methods read what a request asks for across its fields (the prompts, the image parts, the fields that ask for
a grammar, the token limit), so every later step reads them one way.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Request(_Strict):
    # Undeclared fields are kept (model_extra) so that OpenAI fields this server does not implement are refused by
    # name (UNIMPLEMENTED); other unknown fields are ignored, as OpenAI's own API and vLLM ignore them.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str  # a data:image/...;base64 URL, or file:// inside the server's --allowed-media-dir
    # Accepted for OpenAI's clients; each family preprocesses images at its own fixed resolution.
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        """The message's text: its text parts joined (image parts left out)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def images(self) -> list[tuple[int, ImagePart]]:
        """The message's image parts with their indices in `content`."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2 ** 63), le=2 ** 64 - 1)
    user: str | None = None
    # vLLM's extensions, accepted as vLLM accepts them.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # Structured output: OpenAI's response_format and logit_bias (token id as a string -> bias), vLLM's guided_*.
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1)

    def grammar_fields(self) -> list[str]:
        """The fields that ask for a grammar (at most one may: the validate step refuses more)."""
        fmt = self.response_format
        return [name for name, on in (("response_format", fmt is not None and fmt.type != "text"),
                                      ("guided_json", self.guided_json is not None),
                                      ("guided_regex", self.guided_regex is not None),
                                      ("guided_choice", self.guided_choice is not None)) if on]


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function, with tools offered: the output must be a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def grammar_fields(self) -> list[str]:
        return super().grammar_fields() + (["tool_choice"] if self.forces_tool_call() else [])

    def image_parts(self) -> list[tuple[int, int, ImagePart]]:
        """The image parts of every message as (message index, part index, part), in order of appearance."""
        return [(i, j, part) for i, m in enumerate(self.messages) for j, part in m.images()]

    def max_new_tokens(self) -> int | None:
        """The tokens asked for; None: whatever the context leaves after the prompt (as vLLM does)."""
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """The top log-probabilities asked for per token, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or a list of token ids."""
        prompts = self.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def max_new_tokens(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def logprob_count(self) -> int | None:
        return self.logprobs


# OpenAI request fields the server does not implement, by request type, each with the test of its neutral value
# (the value that asks for nothing the server does not do). Anything else in one of them is a 400 naming it.
_NONE_OR = lambda *ok: lambda v, body: v in ok  # noqa: E731
_CHAT_ONLY = {
    "functions": _NONE_OR([]), "function_call": _NONE_OR("none"), "audio": _NONE_OR(),
    "modalities": _NONE_OR(["text"]), "prediction": _NONE_OR(), "reasoning_effort": _NONE_OR(),
    "web_search_options": _NONE_OR(), "store": _NONE_OR(False), "metadata": _NONE_OR({}),
    "service_tier": _NONE_OR("auto", "default")}
UNIMPLEMENTED = {
    "ChatCompletionRequest": _CHAT_ONLY,
    "CompletionRequest": {"suffix": _NONE_OR(""), "best_of": lambda v, body: v in (1, body.n)},
}


# --- responses -----------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "day0jax"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class SpeculativeUsage(BaseModel):
    """day0jax's extension of usage, with speculative decoding on: tokens drafted for the request and drafts the
    model accepted."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
