"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Requests are validated strictly (no "16" for an integer, no ``true`` for a number, no NaN or
infinity); a failed validation becomes a 400 in OpenAI's error shape (see ``errors.py``). Unknown
fields are accepted and ignored, as vLLM does, except the Memory Caching overrides: any extra
field whose name starts with ``mc_``, the ``mc_overrides`` object, and ``segment_len``. Of
those only ``mc_top_k`` goes to the engine (which allows it for ssc models); the others are fixed
per model and server and refused with a 400 (see ``params.py``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    field_validator,
)

MAX_N = 128  # completions per request (OpenAI's limit)
MAX_LOGPROBS = 20  # alternatives per token (mcserve.engine.sampling_params.MAX_LOGPROBS)
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_STOP_CHARS = 512  # characters of one stop string
MAX_TOOLS = 128  # functions in one chat request (OpenAI's limit)
MAX_PROMPTS = 256  # prompts in one completions request
MAX_MESSAGES = 2048  # messages in one chat (or /tokenize) request
MAX_CONTENT_PARTS = 2048  # content parts in one chat request, all messages together
DEFAULT_MAX_TOKENS = 16  # completions' max_tokens when absent or null (OpenAI's default)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

TokenId = Annotated[StrictInt, Field(ge=0)]
# a list of token ids stops at its first bad item: a body can hold a million of them, and one
# error each would cost the event loop seconds
TokenIds = Annotated[list[TokenId], Field(fail_fast=True)]
Number = StrictInt | StrictFloat
McValue = StrictInt | StrictFloat | StrictBool | StrictStr


class OpenAIModel(BaseModel):
    """Base of the request bodies: strict types, finite numbers, extra fields kept."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")

    def mc_fields(self) -> dict[str, Any]:
        """The MC overrides: ``mc_overrides`` merged with the extra ``mc_*`` fields."""
        out: dict[str, Any] = dict(getattr(self, "mc_overrides", None) or {})
        for key, value in (self.model_extra or {}).items():
            if key.startswith("mc_"):
                out[key] = value
        return out


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


def _check_stop(value: Any) -> Any:
    """OpenAI's bounds on stop strings, said plainly (a union's own errors would not)."""
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list):
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
        if any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
    return value


class SamplingFields(OpenAIModel):
    """The sampling fields shared by completions and chat completions."""

    model: StrictStr | None = Field(
        None, description="The served model name (GET /v1/models); optional."
    )
    temperature: float | None = Field(1.0, ge=0, description="0 is greedy.")
    top_p: float | None = Field(1.0, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, description="0 or -1: disabled (vLLM).")
    min_p: float | None = Field(None, ge=0, le=1)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description=f"A string or up to {MAX_STOP} strings of at most {MAX_STOP_CHARS} "
        "characters each.")
    stop_token_ids: TokenIds | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, description="Accepted and ignored.")
    logit_bias: dict[str, float] | None = Field(None, description="Not supported: must be empty.")
    mc_overrides: dict[str, McValue] | None = Field(
        None,
        description="Per-request Memory Caching overrides: only mc_top_k (ssc models); "
        "segment_len, mc_variant and mc_mode are fixed per server. Extra top-level fields "
        "named mc_* are merged in.",
    )
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': "
        "{'name', 'schema', 'strict'}}: the output follows the schema."
    )
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's constraint: exactly one of json (a schema), regex, choice "
        "(a list of strings), grammar (Lark or GBNF), json_object (true)."
    )
    guided_json: dict[str, Any] | StrictStr | None = Field(
        None, description="vLLM's older form of structured_outputs.json.")
    guided_regex: StrictStr | None = Field(
        None, description="vLLM's older form of structured_outputs.regex.")
    guided_choice: list[StrictStr] | None = Field(
        None, description="vLLM's older form of structured_outputs.choice.")
    guided_grammar: StrictStr | None = Field(
        None, description="vLLM's older form of structured_outputs.grammar.")

    @field_validator("stop", mode="before")
    @classmethod
    def _bounded_stop(cls, value: Any) -> Any:
        return _check_stop(value)


def _prompt_kind(value: Any) -> str | None:
    """Which form of prompt ``value`` is, from its first item: each form is then validated
    alone (a plain union would validate a long list once per form, errors and all)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        if not value or isinstance(value[0], str):
            return "texts"
        return "id_lists" if isinstance(value[0], list) else "ids"
    return None


PromptType = Annotated[
    Annotated[StrictStr, Tag("text")]
    | Annotated[list[StrictStr], Field(fail_fast=True), Tag("texts")]
    | Annotated[TokenIds, Tag("ids")]
    | Annotated[list[TokenIds], Field(fail_fast=True), Tag("id_lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="Input should be a string, a list of strings, a list of "
                  "token ids or a list of token-id lists"),
]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptType = Field(
        ..., description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: StrictInt | None = Field(DEFAULT_MAX_TOKENS, ge=0,
                                         description="0 only with echo; null: 16.")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)
    suffix: StrictStr | None = Field(None, description="Not supported.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, value: Any) -> Any:
        # before the items are validated: a body of 400000 one-token prompts is refused at once
        if isinstance(value, list) and value and not isinstance(value[0], int) \
                and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: StrictStr
    arguments: StrictStr = Field("{}", description="The arguments as a JSON text.")


class ToolCallIn(BaseModel):
    """A tool call of an earlier assistant message, as the client sends it back."""

    model_config = ConfigDict(strict=True, extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _no_empty_parts(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("content must not be an empty list of parts")
        return value


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="The JSON schema of the arguments; absent: no arguments.")
    strict: StrictBool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["function"]
    function: NamedFunction


def _check_messages(value: Any) -> Any:
    """Before the messages are validated: a body of 100000 messages is refused at once (a large
    body is refused earlier still, by the same caps, in ``shape.py``)."""
    if isinstance(value, list):
        if len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} messages per request")
        parts = sum(len(m["content"]) for m in value
                    if isinstance(m, dict) and isinstance(m.get("content"), list))
        if parts > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per request")
    return value


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none: tools are not shown to the model; auto (the default with "
        "tools): the model may call them; required, or a named function: it must.")
    parallel_tool_calls: StrictBool | None = Field(
        None, description="false: at most one tool call per answer.")

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return _check_messages(value)


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: ``prompt`` or ``messages`` (chat template applied)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(fail_fast=True)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True

    @field_validator("messages", mode="before")
    @classmethod
    def _few_messages(cls, value: Any) -> Any:
        return _check_messages(value)


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: StrictStr | None = None
    tokens: TokenIds


# --- responses -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ResponseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprobTop(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(ResponseModel):
    name: str | None = None  # in a call's first chunk only
    arguments: str | None = None  # a piece of the JSON text; the pieces concatenate


class DeltaToolCall(ResponseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mcserve"
    root: str | None = None
    max_model_len: int | None = None  # the server's context limit per sequence
    # the context length the model was trained at; longer contexts are served, with a
    # start-up warning, since a recurrent model may or may not generalise beyond it
    max_position_embeddings: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str
