"""The OpenAI API schema as pydantic models: requests (the parse step of the request path) and the response objects
the format step fills.

Requests are strict (a string where a number belongs is a 400, not converted); fields not declared are ignored.
A few methods read what a request asks for across its fields (the prompts, the image parts, the fields that ask for
a grammar, the token limit, the chat template's variables), so every later step reads them one way. A Responses API
request is read as the chat request it amounts to (`ResponsesRequest.chat`), which then takes the chat's path.
"""

from __future__ import annotations

import time
import uuid
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


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


class VideoURL(_Strict):
    url: str  # an animated GIF, WebP or PNG as a data: URL, or file:// inside the server's --allowed-media-dir


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]


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
    # An assistant's earlier reasoning (`reasoning_content` is the older name); the template keeps or drops it.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        """The message's text: its text parts joined (image parts left out)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content or ""

    def images(self) -> list[tuple[int, ImagePart | VideoPart]]:
        """The message's image and video parts with their indices in `content`."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, (ImagePart, VideoPart))]


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    model: str | None = None  # None: the served model
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
    # vLLM's: prefix-cache hits (and so cached_tokens) only between requests with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

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
    # Reasoning models: variables for the chat template (vLLM's; {"enable_thinking": false} switches Qwen3's
    # thinking off), the effort of templates that read `reasoning_effort` (gpt-oss), and whether the response
    # carries the reasoning (vLLM's include_reasoning).
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    include_reasoning: bool = True

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables beyond messages and tools: `chat_template_kwargs`, and `reasoning_effort`
        as templates read it (low, medium or high: "minimal" is "low")."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", "low" if self.reasoning_effort == "minimal" else
                              self.reasoning_effort)
        return kwargs

    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function, with tools offered: the output must be a call."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def grammar_fields(self) -> list[str]:
        return super().grammar_fields() + (["tool_choice"] if self.forces_tool_call() else [])

    def image_parts(self) -> list[tuple[int, int, ImagePart | VideoPart]]:
        """The image and video parts of every message as (message index, part index, part), in order of
        appearance."""
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
    "modalities": _NONE_OR(["text"]), "prediction": _NONE_OR(), "web_search_options": _NONE_OR(),
    "store": _NONE_OR(False), "metadata": _NONE_OR({}),
    "service_tier": _NONE_OR("auto", "default")}
UNIMPLEMENTED = {
    "ChatCompletionRequest": _CHAT_ONLY,
    "CompletionRequest": {"suffix": _NONE_OR(""), "best_of": lambda v, body: v in (1, body.n),
                          "echo": _NONE_OR(False)},
    "ResponsesRequest": {
        "background": _NONE_OR(False), "conversation": _NONE_OR(), "prompt": _NONE_OR(), "include": _NONE_OR([]),
        "truncation": _NONE_OR("disabled"), "top_logprobs": _NONE_OR(0), "max_tool_calls": _NONE_OR(),
        "service_tier": _NONE_OR("auto", "default")},
}


# --- the Responses API ----------------------------------------------------------------------------------------------

class ResponseText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str


class ResponseRefusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class ResponseImage(_Strict):
    type: Literal["input_image"]
    image_url: str  # a data:image/...;base64 URL, or file:// inside the server's --allowed-media-dir
    detail: Literal["auto", "low", "high"] | None = None


ResponseContent = Annotated[ResponseText | ResponseRefusal | ResponseImage, Field(discriminator="type")]


class ResponseMessageInput(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ResponseContent]


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ResponseReasoningInput(_Strict):
    type: Literal["reasoning"]
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None


class ResponseFunctionCallInput(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class ResponseFunctionOutputInput(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponseContent]


def _item_type(item) -> str:
    # A message may leave its type out ({"role": "user", "content": "..."}).
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


ResponseInputItem = Annotated[
    Annotated[ResponseMessageInput, Tag("message")] | Annotated[ResponseReasoningInput, Tag("reasoning")]
    | Annotated[ResponseFunctionCallInput, Tag("function_call")]
    | Annotated[ResponseFunctionOutputInput, Tag("function_call_output")], Discriminator(_item_type)]


class ResponsesTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponsesTextConfig(_Strict):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; the reasoning comes as its text


class ResponsesRequest(_Request):
    """POST /v1/responses: `input` (a text, or items: messages, reasoning, function calls and their outputs) with
    `instructions`, read as a chat request (`chat`). Nothing is stored: `previous_response_id` and `store: true`
    are refused."""

    model: str | None = None
    input: str | Annotated[list[ResponseInputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[ResponsesTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool = True
    text: ResponsesTextConfig | None = None
    reasoning: ResponsesReasoning | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    def chat(self) -> "ChatCompletionRequest":
        """The chat request this asks for: `instructions` as the first (system) message, the input items as
        messages (reasoning and function calls joined into the assistant turn they belong to, function outputs as
        tool messages), `text.format` as `response_format`, `max_output_tokens` as `max_completion_tokens`."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "stream": self.stream,
            "temperature": self.temperature, "top_p": self.top_p, "user": self.user, "cache_salt": self.cache_salt,
            "max_completion_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                               for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, ResponsesNamedFunction):
            choice = {"type": "function", "function": {"name": choice.name}}
        fields["tool_choice"] = choice
        fmt = self.text.format if self.text else None
        if fmt is not None:
            fields["response_format"] = {"type": fmt.type} if fmt.type != "json_schema" else {
                "type": "json_schema", "json_schema": {
                    "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict,
                    "description": fmt.description}}
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    def _messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [ResponseMessageInput(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        reasoning = None  # a reasoning item's text, for the assistant turn that follows it
        for item in items:
            if isinstance(item, ResponseReasoningInput):
                text = "".join(c.text for c in item.content or []) or "\n".join(s.text for s in item.summary)
                reasoning = f"{reasoning}\n\n{text}" if reasoning else text
            elif isinstance(item, ResponseMessageInput):
                message = {"role": item.role, "content": _chat_content(item.content)}
                if item.role == "assistant" and reasoning is not None:
                    message["reasoning"], reasoning = reasoning, None
                out.append(message)
            elif isinstance(item, ResponseFunctionCallInput):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and reasoning is None:
                    out[-1].setdefault("tool_calls", []).append(call)  # the same turn's next call
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call],
                                **({"reasoning": reasoning} if reasoning is not None else {})})
                    reasoning = None
            else:
                output = item.output if isinstance(item.output, str) else _chat_content(item.output)
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        return out


def _chat_content(content: str | list) -> str | list[dict]:
    """Responses content as chat content: its text, or its parts when it holds images."""
    if isinstance(content, str):
        return content
    if not any(isinstance(p, ResponseImage) for p in content):
        return "".join(p.refusal if isinstance(p, ResponseRefusal) else p.text for p in content)
    return [{"type": "image_url", "image_url": {"url": p.image_url}} if isinstance(p, ResponseImage) else
            {"type": "text", "text": p.refusal if isinstance(p, ResponseRefusal) else p.text} for p in content]


# Chat request fields as a Responses request names them (its errors name the field the client sent).
_RESPONSES_PARAMS = [(r"^messages.*", "input"), (r"^response_format\.json_schema", "text.format"),
                     (r"^response_format", "text.format"), (r"^max_completion_tokens", "max_output_tokens"),
                     (r"^reasoning_effort", "reasoning.effort"), (r"^(tools\[\d+\])\.function", r"\1")]


def responses_param(param: str | None) -> str | None:
    """The Responses API's name of a chat request field (an error's `param`)."""
    for pattern, name in _RESPONSES_PARAMS:
        if param and re.match(pattern, param):
            return re.sub(pattern, name, param, count=1)
    return param


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a `prompt`, or `messages` rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (the template writes them)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def chat(self) -> "ChatCompletionRequest":
        """The chat request whose prompt `messages` asks for."""
        return ChatCompletionRequest.model_validate({
            "messages": [m.model_dump(exclude_none=True) for m in self.messages or []] or [{"role": "user"}],
            "chat_template_kwargs": self.chat_template_kwargs})


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[int]


# --- responses -----------------------------------------------------------------------------------------------

def new_id(prefix: str, separator: str = "-") -> str:
    return f"{prefix}{separator}{uuid.uuid4().hex}"


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
    root: str | None = None  # a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model
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


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
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
    reasoning: str | None = None
    reasoning_content: str | None = None  # the same, under the name older clients read
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
    reasoning: str | None = None
    reasoning_content: str | None = None
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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = []
    content: list[ResponseReasoningText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


ResponseOutputItem = ResponseOutputMessage | ResponseReasoningItem | ResponseFunctionCall


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response of the Responses API (`object: "response"`), whole, or as the lifecycle events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}


class ResponseEvent(BaseModel):
    """One server-sent event of a streamed response: its `type`, its number in the stream, and its fields."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int
