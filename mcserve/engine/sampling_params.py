"""``SamplingParams``: one request's decoding settings (vLLM-compatible names, defaults and
semantics) and their validation. Pure Python, no torch: the HTTP server builds and checks
these without loading the engine; ``mcserve.engine.sampling`` (the torch ``Sampler``)
re-exports them. See docs/engine-sampling.md.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from mcserve.errors import InvalidRequestError

__all__ = ["JSON_OPTIONS", "MAX_LOGPROBS", "MAX_STRUCTURED_CHARS", "SamplingParams",
           "StructuredOutputsParams"]

MAX_LOGPROBS = 20  # the most alternatives per token that ``logprobs`` / ``prompt_logprobs`` allow
_GREEDY_EPS = 1e-5
# the largest constraint (a schema's JSON text, a regex, a grammar, the choices together)
MAX_STRUCTURED_CHARS = 256 * 1024
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# how JSON is generated under a constraint (llguidance's JSON options): no free whitespace
# between tokens, ", " and ": " separators; a model may otherwise emit whitespace for as long
# as it likes, which a weak model does
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _invalid(name: str, message: str) -> InvalidRequestError:
    """The error for field ``name``: its message starts with the name, ``param`` is the name."""
    return InvalidRequestError(f"{name} {message}", param=name)


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if not _is_int(value):
        raise _invalid(name, f"must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise _invalid(name, f"must be {bound}, got {value}")


def _check_float(name: str, value: object) -> float:
    if not _is_number(value) or not math.isfinite(value):
        raise _invalid(name, f"must be a finite number, got {value!r}")
    return float(value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _invalid(name, f"must be a boolean, got {value!r}")


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's ``StructuredOutputsParams``): exactly one of

    * ``json``: a JSON schema (a dict, or its JSON text);
    * ``regex``: a regular expression the whole output matches (Rust ``regex`` syntax);
    * ``choice``: a list of strings, the output is one of them;
    * ``grammar``: a context-free grammar, in llguidance's Lark syntax or llama.cpp's GBNF;
    * ``json_object``: True: any JSON object.

    Invalid values raise ``InvalidRequestError`` with ``param="structured_outputs"``. Whether
    the constraint compiles (a schema feature the library lacks, a bad regex) is checked by
    the engine when the request is added.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _invalid("structured_outputs", "must set exactly one of "
                           f"{', '.join(_STRUCTURED_KINDS)}, got "
                           f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise _invalid("structured_outputs", f"json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise _invalid("structured_outputs", "json must be a JSON schema (an object), "
                               f"got {type(parsed).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _invalid("structured_outputs", f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _invalid("structured_outputs",
                               "choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise _invalid("structured_outputs", "json_object must be true when given")
        if len(self.key[1]) > MAX_STRUCTURED_CHARS:
            raise _invalid("structured_outputs", f"the {self.kind} constraint is longer than "
                           f"{MAX_STRUCTURED_CHARS} characters")

    @property
    def kind(self) -> str:
        """Which constraint this is: ``json``, ``regex``, ``choice``, ``grammar`` or
        ``json_object``."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, text)``: the constraint as a hashable key (compiled grammars are cached by
        it); a schema's text is its JSON with sorted keys."""
        kind = self.kind
        if kind == "json":
            value = self.json
            if isinstance(value, str):
                value = json.loads(value)
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    """Decoding settings of one request. Names, defaults and meanings follow vLLM.

    ``stop`` and ``stop_token_ids`` are normalised to lists (``None`` -> ``[]``). Invalid values
    raise ``InvalidRequestError`` (a ``ValueError``) whose ``param`` is the argument's name and
    whose message starts with it.
    """

    n: int = 1  # completions per request
    max_tokens: int | None = 16  # None: until EOS / a stop / the context limit
    temperature: float = 1.0  # 0 (below 1e-5): greedy
    top_p: float = 1.0  # nucleus: smallest set of tokens with total probability >= top_p
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: disabled
    min_p: float = 0.0  # drop tokens whose probability < min_p * the top token's probability
    seed: int | None = None  # per-request seed: the same seed reproduces the same tokens
    stop: str | list[str] | None = None  # stop strings (not part of the output unless asked)
    stop_token_ids: list[int] | None = None  # extra token ids that end the completion
    ignore_eos: bool = False  # keep going past EOS
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # >1 discourages seen tokens (logit / p if > 0 else * p)
    logprobs: int | None = None  # alternatives reported per generated token (0: sampled only)
    prompt_logprobs: int | None = None  # alternatives reported per prompt token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a constraint on the output (JSON schema, regex, choice, grammar); a dict is converted
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise _invalid("temperature", f"must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise _invalid("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise _invalid("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not _is_int(self.seed):
            raise _invalid("seed", f"must be an integer or None, got {self.seed!r}")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise _invalid(name, f"must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _invalid("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = [k for k in so if k not in _STRUCTURED_KINDS]
            if unknown:
                raise _invalid("structured_outputs", f"has unknown fields {unknown!r} (allowed: "
                               f"{', '.join(_STRUCTURED_KINDS)})")
            self.structured_outputs = StructuredOutputsParams(**so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise _invalid("structured_outputs", "must be a StructuredOutputsParams or a dict, "
                           f"got {type(so).__name__}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise _invalid("stop", f"must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise _invalid("stop", "must not contain empty strings")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise _invalid("stop_token_ids",
                           f"must be a list of non-negative integers, got {ids!r}")
        return list(ids)

    @property
    def greedy(self) -> bool:
        """True when the temperature is (numerically) zero: the argmax token is taken."""
        return self.temperature < _GREEDY_EPS
