"""What the engine hands back for a request (vLLM-shaped, plain dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, as vLLM reports it (``vllm.sequence.Logprob``)."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token under the raw distribution
    decoded_token: str | None = None  # the token's text, when the engine has a tokenizer


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request, cumulative so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # per generated token: {token_id: Logprob} holding the sampled token and the top
    # ``SamplingParams.logprobs`` alternatives; None when logprobs were not asked for
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # per prompt token: {token_id: Logprob} (None for the first token, which has no context);
    # filled when SamplingParams.prompt_logprobs is set
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the request failed inside the engine
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
