"""``ServerState``: what every route of one app shares (the engine, the served model's limits,
the tokenizer, the metrics), and the submission of requests to the engine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from mcserve.engine.sampling_params import SamplingParams
from mcserve.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestStream,
)
from mcserve.server.errors import RETRY_AFTER_QUEUE_S, APIError, engine_error, unavailable
from mcserve.server.metrics import ServerMetrics
from mcserve.server.prompts import PromptEncoder
from mcserve.server.tool_parsers import ToolParser, choose_parser

# bound on the token-string cache: a vocabulary is far smaller, a runaway tokenizer is not
_TOKEN_STR_CACHE = 1_000_000


@dataclass
class ServerState:
    aengine: AsyncEngine
    served_model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any
    metrics: ServerMetrics
    shutdown_grace_s: float = 5.0
    # the model's Memory Caching variant, and whether it selects cached segments (ssc: the
    # only variant where mc_top_k means something per request); None: the engine decides
    mc_variant: str | None = None
    mc_selects: bool | None = None
    resume_points: bool = False  # the engine keeps resume points: send it chat message ends
    tool_call_parser: str = "auto"  # --tool-call-parser: auto, hermes or json
    created: int = field(default_factory=lambda: int(time.time()))
    # HTTP requests whose response is not fully sent yet (GuardMiddleware counts them): a
    # shutdown waits for it to reach 0 before it lets the HTTP server close connections
    http_in_flight: int = 0
    _token_str: dict[int, str] = field(default_factory=dict)
    _encoder: PromptEncoder | None = None
    _tool_parser: ToolParser | None = None

    @property
    def tool_parser(self) -> ToolParser:
        """The parser of tool calls in answers (``--tool-call-parser``; ``auto`` reads the
        chat template)."""
        if self._tool_parser is None:
            self._tool_parser = choose_parser(self.tool_call_parser, self.chat_template)
        return self._tool_parser

    @property
    def chat_template(self) -> str:
        """The source of the chat template prompts are rendered with ("" when unknown)."""
        from_tok = getattr(self.tokenizer, "chat_template", None)
        if isinstance(from_tok, str) and from_tok:
            return from_tok
        from mcserve.engine.tokenizer import DEFAULT_CHAT_TEMPLATE

        return DEFAULT_CHAT_TEMPLATE

    @property
    def encoder(self) -> PromptEncoder:
        if self._encoder is None:
            self._encoder = PromptEncoder(self.tokenizer, self.max_model_len)
        return self._encoder

    @property
    def draining(self) -> bool:
        """True once the server shuts down (or the engine died): new requests get 503."""
        return not self.aengine.accepting

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.served_model_name}' (GET /v1/models)",
                           param="model", code="model_not_found")

    def token_str(self, token_id: int) -> str:
        """The text of one token, special tokens included (logprobs name every token)."""
        s = self._token_str.get(token_id)
        if s is None:
            try:
                s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            except TypeError:
                s = self.tokenizer.decode([token_id])
            if len(self._token_str) < _TOKEN_STR_CACHE:
                self._token_str[token_id] = s
        return s

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}: token id {bad} is out of range [0, "
                           f"{self.vocab_size})", param=param)

    async def submit(
        self, requests: list[tuple[str, str | None, list[int] | None]], params: SamplingParams,
        mc_overrides: dict[str, Any] | None, resume_positions: list[int] | None = None,
    ) -> list[RequestStream]:
        """Queue the requests and wait until the engine took them all (or refused one).
        ``resume_positions``: where the engine keeps resume points (chat message ends)."""
        try:
            kw = {"resume_positions": resume_positions} if resume_positions else {}
            streams = self.aengine.submit_many(requests, params, mc_overrides=mc_overrides,
                                               **kw)
        except QueueFullError as e:
            raise APIError(429, str(e), code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_QUEUE_S)}) from None
        except (EngineShutdownError, EngineDeadError) as e:
            raise unavailable(str(e)) from None
        try:
            results = await asyncio.gather(*(s.wait_accepted() for s in streams),
                                           return_exceptions=True)
        except BaseException:
            for s in streams:
                s.abort()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # all or nothing: a multi-prompt request the engine partly refused is refused whole
            for s in streams:
                s.abort()
            raise engine_error(errors[0])
        return streams
