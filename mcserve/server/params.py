"""From a request body to what the engine takes: ``SamplingParams`` and the per-request Memory
Caching overrides. Whatever the engine would never accept is refused here with a 400 that says
why, so that a client learns it from the API rather than from an engine message."""

from __future__ import annotations

import math
from typing import Any

from mcserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from mcserve.errors import InvalidRequestError
from mcserve.server import protocol as P
from mcserve.server.errors import APIError
from mcserve.server.prompts import check_utf8
from mcserve.server.state import ServerState


def sampling_params(
    st: ServerState, body: P.SamplingFields, max_tokens: int | None, logprobs: int | None,
    prompt_logprobs: int | None, *, structured: StructuredOutputsParams | None = None,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    """The engine's sampling parameters for ``body`` (400 for what the API does not support).
    ``structured``: the request's constraint (``structured.structured_spec``);
    ``max_tokens_param``: the field the client sent the length in (``max_completion_tokens``
    in chat), named by a 400 about it."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    if max_tokens is not None and max_tokens > st.max_model_len:
        raise APIError(400, f"{max_tokens_param}={max_tokens} is more than the model's context "
                       f"(max_model_len={st.max_model_len})", param=max_tokens_param)
    if body.stop_token_ids:
        st.check_token_ids(body.stop_token_ids, "stop_token_ids")
    for i, stop in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
        check_utf8(stop, "stop", what=f"stop[{i}]")
    kw: dict[str, Any] = {
        "n": body.n, "max_tokens": max_tokens,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None else body.top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "seed": body.seed, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None
        else body.repetition_penalty,
        "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "structured_outputs": structured,
    }
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None


# The MC settings a request may carry; the engine decides whether this model allows them
# (mc_top_k: ssc only, since it salts the prefix hash of the blocks it computes).
PER_REQUEST_MC = ("mc_top_k",)

# Settings fixed per model and server, with the reason a request cannot change them: the
# cached checkpoints (the memory states the prefix cache shares between requests) exist under
# one value of each.
_FIXED_MC = {
    "segment_len": ("segment boundaries are a property of the cached checkpoints, fixed per "
                    "model and server", "--segment-len"),
    "mc_variant": ("the cached checkpoints are computed and read under one Memory Caching "
                   "variant, fixed per model and server", "--mc-variant"),
    "mc_mode": ("the cached checkpoints are computed under one Memory Caching mode, fixed per "
                "model and server", "--mc-mode"),
}


def _refuse_mc(key: str) -> APIError:
    fixed = _FIXED_MC.get(key)
    if fixed is not None:
        why, flag = fixed
        return APIError(400, f"{key} cannot be set per request: {why}; set it when starting "
                        f"the server (mcserve serve {flag})", param=key)
    return APIError(400, f"{key} is not a per-request setting: a request may set only "
                    f"{', '.join(PER_REQUEST_MC)} (for mc_variant='ssc' models)", param=key)


def mc_overrides(st: ServerState, body: P.OpenAIModel) -> dict[str, Any] | None:
    """The per-request MC overrides of ``body`` (``mc_overrides`` and extra ``mc_*`` fields)."""
    mc = body.mc_fields()
    # segment_len has no mc_ prefix: a client may well send it as a top-level field
    if body.model_extra and "segment_len" in body.model_extra:
        raise _refuse_mc("segment_len")
    for key, value in mc.items():
        if key not in PER_REQUEST_MC:
            raise _refuse_mc(key)
        if not isinstance(value, (int, float, str, bool)) or (
                isinstance(value, float) and not math.isfinite(value)):
            raise APIError(400, f"{key} must be a number, a string or a boolean", param=key)
    if "mc_top_k" in mc and st.mc_selects is False:
        raise APIError(400, "mc_top_k applies only to models whose Memory Caching variant "
                       "selects cached segments (mc_variant='ssc'); this model's variant is "
                       f"{st.mc_variant!r}, which reads every cached segment: drop mc_top_k",
                       param="mc_top_k")
    return mc or None
