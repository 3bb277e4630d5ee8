"""Caps on the shape of a large JSON request body, checked on the raw bytes before any parse.

``json.loads`` and pydantic's validation hold the GIL for as long as they run, on the event loop
or on any thread: a 4 MiB body of 400,000 one-id prompts takes a quarter of a second to parse,
one of 110,000 chat messages half a second to validate, and every other request (``/health``
included) waits meanwhile. So ``GuardMiddleware`` gives a body of more than
``SHAPE_CHECK_BYTES`` sent to a route that validates it to ``check_shape`` first. The check
walks the body's top levels (strings and scalars through ``json``'s C scanner, a flat list of
numbers counted by its commas) and stops at the first list over its cap:

* ``prompt`` (completions): at most ``MAX_PROMPTS`` prompts; a token-id list of
  ``max_model_len`` ids or more (it never fits);
* ``messages`` (chat, ``/tokenize``): at most ``MAX_MESSAGES`` messages and at most
  ``max_model_len`` (each takes at least one token), at most ``MAX_CONTENT_PARTS`` content parts
  in all;
* ``stop``: at most ``MAX_STOP`` strings; ``stop_token_ids``: at most ``vocab_size`` ids;
* anything else (``logit_bias``, ``tools``, unknown fields, a message's other fields): at most
  ``MAX_OTHER_VALUES`` values inside lists and objects, in all.

Over a cap: a 400 in OpenAI's shape naming the field. Within the caps the walk takes a few
milliseconds and the body is then parsed and validated as usual (the caps the models know of
are validated there too, for bodies of every size). A body the walk cannot read (not JSON, not
an object) is left to that usual parse, which says what is wrong with it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from json.decoder import scanstring

from mcserve.server import protocol as P

# smaller bodies are parsed and validated at once: at most ~30,000 JSON values, a few ms
SHAPE_CHECK_BYTES = 64 * 1024
# values inside the lists and objects of fields without a cap of their own, in all
MAX_OTHER_VALUES = 4096

_WS = re.compile(r"[ \t\n\r]*")
_scan_once = json.JSONDecoder().scan_once


@dataclass(frozen=True)
class ShapeLimits:
    """The served model's bounds the caps derive from."""

    max_model_len: int
    vocab_size: int


class ShapeError(Exception):
    """A body over a cap: answered as a 400 naming ``param``."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message = message
        self.param = param


class _Malformed(Exception):
    pass


def check_shape(path: str, body: bytes, limits: ShapeLimits) -> ShapeError | None:
    """The cap ``body`` (sent to ``path``) is over, if any (see the module docstring)."""
    fields = _ROUTES.get(path)
    if fields is None or len(body) <= SHAPE_CHECK_BYTES:
        return None
    try:
        text = body.decode(json.detect_encoding(body), "surrogatepass")  # as json.loads does
        _Walker(text, limits, fields).walk()
    except ShapeError as e:
        return e
    except (_Malformed, ValueError, IndexError, StopIteration, RecursionError):
        pass  # not a JSON object: the usual parse says what is wrong
    return None


class _Walker:
    def __init__(self, s: str, limits: ShapeLimits, fields: dict[str, _Rule]):
        self.s = s
        self.limits = limits
        self.fields = fields
        self.other_left = MAX_OTHER_VALUES
        self.parts_left = P.MAX_CONTENT_PARTS

    def walk(self) -> None:
        i = self.ws(0)
        if self.s[i:i + 1] == "{":
            self.members(i, self.field)

    def field(self, key: str, i: int) -> int:
        rule = self.fields.get(key)
        return rule(self, i) if rule is not None else self.other(i, key)

    # --- reading -------------------------------------------------------------------------------

    def ws(self, i: int) -> int:
        m = _WS.match(self.s, i)
        assert m is not None
        return m.end()

    def is_list(self, i: int) -> bool:
        return self.s[i:i + 1] == "["

    def flat(self, i: int) -> tuple[int, int] | None:
        """(length, end) of the list at ``i`` when it holds no string, list or object (numbers
        and literals: counted by its commas, at C speed); None otherwise."""
        s = self.s
        end = s.find("]", i)
        if end < 0 or any(s.find(c, i + 1, end) >= 0 for c in '"[{'):
            return None
        if self.ws(i + 1) == end:
            return 0, end + 1
        return s.count(",", i + 1, end) + 1, end + 1

    def items(self, i: int, cap: int, item: Callable[[int], int]) -> tuple[int, int]:
        """(length, end) of the list at ``i``, each item read by ``item(start) -> end``; as soon
        as it has more than ``cap`` items, (cap + 1, -1)."""
        s = self.s
        i = self.ws(i + 1)
        if s[i:i + 1] == "]":
            return 0, i + 1
        n = 0
        while True:
            n += 1
            if n > cap:
                return n, -1
            i = self.ws(item(i))
            c = s[i:i + 1]
            if c == "]":
                return n, i + 1
            if c != ",":
                raise _Malformed
            i = self.ws(i + 1)

    def members(self, i: int, member: Callable[[str, int], int]) -> int:
        """The end of the object at ``i``, each value read by ``member(key, start) -> end``."""
        s = self.s
        i = self.ws(i + 1)
        if s[i:i + 1] == "}":
            return i + 1
        while True:
            if s[i:i + 1] != '"':
                raise _Malformed
            key, i = scanstring(s, i + 1)
            i = self.ws(i)
            if s[i:i + 1] != ":":
                raise _Malformed
            i = self.ws(member(key, self.ws(i + 1)))
            c = s[i:i + 1]
            if c == "}":
                return i + 1
            if c != ",":
                raise _Malformed
            i = self.ws(i + 1)

    # --- values without a cap of their own -----------------------------------------------------

    def other(self, i: int, param: str) -> int:
        """The end of the value at ``i``; the values inside it count against
        ``MAX_OTHER_VALUES`` (a 400 naming ``param`` beyond)."""
        c = self.s[i:i + 1]
        if c == "[":
            flat = self.flat(i)
            if flat is not None:
                self.spend(flat[0], param)
                return flat[1]
            return self.items(i, len(self.s), lambda j: self.counted(j, param))[1]
        if c == "{":
            return self.members(i, lambda _, j: self.counted(j, param))
        return _scan_once(self.s, i)[1]  # a string or a scalar

    def counted(self, i: int, param: str) -> int:
        self.spend(1, param)
        return self.other(i, param)

    def spend(self, n: int, param: str) -> None:
        self.other_left -= n
        if self.other_left < 0:
            raise ShapeError(f"{param}: more than {MAX_OTHER_VALUES} values in the lists and "
                             "objects of the request (prompt, messages, stop and "
                             "stop_token_ids apart)", param)

    # --- the fields with caps ------------------------------------------------------------------

    def prompt(self, i: int) -> int:
        if not self.is_list(i):
            return self.other(i, "prompt")
        flat = self.flat(i)
        if flat is not None:  # one token-id list
            self.check_ids(flat[0], 0)
            return flat[1]
        index = -1

        def item(j: int) -> int:
            nonlocal index
            index += 1
            if self.is_list(j) and (ids := self.flat(j)) is not None:
                self.check_ids(ids[0], index)
                return ids[1]
            return self.other(j, "prompt")

        _, end = self.items(i, P.MAX_PROMPTS, item)
        if end < 0:  # the words of serving_completion's check
            raise ShapeError(f"prompt: at most {P.MAX_PROMPTS} prompts per request", "prompt")
        return end

    def check_ids(self, n: int, index: int) -> None:
        L = self.limits.max_model_len
        if n >= L:  # the words of serving_completion's check
            raise ShapeError(f"prompt[{index}] is {n} tokens, longer than max_model_len={L} "
                             "minus one generated token", "prompt")

    def messages(self, i: int) -> int:
        if not self.is_list(i):
            return self.other(i, "messages")
        L = self.limits.max_model_len
        _, end = self.items(i, min(P.MAX_MESSAGES, L), self.message)
        if end < 0:
            if L < P.MAX_MESSAGES:
                raise ShapeError(f"messages: more than max_model_len={L} messages (each takes "
                                 "at least one token of the prompt)", "messages")
            raise ShapeError(f"messages: at most {P.MAX_MESSAGES} messages per request",
                             "messages")
        return end

    def message(self, i: int) -> int:
        if self.s[i:i + 1] != "{":
            return self.other(i, "messages")
        return self.members(i, self.message_member)

    def message_member(self, key: str, i: int) -> int:
        if key != "content" or not self.is_list(i):
            return self.other(i, "messages")
        n, end = self.items(i, self.parts_left, self.part)
        if end < 0:
            raise ShapeError(f"messages: at most {P.MAX_CONTENT_PARTS} content parts per "
                             "request", "messages")
        self.parts_left -= n
        return end

    def part(self, i: int) -> int:
        if self.s[i:i + 1] != "{":
            return self.other(i, "messages")
        return self.members(i, lambda _, j: self.other(j, "messages"))

    def stop(self, i: int) -> int:
        if not self.is_list(i):
            return self.other(i, "stop")
        _, end = self.items(i, P.MAX_STOP, lambda j: self.other(j, "stop"))
        if end < 0:
            raise ShapeError(f"stop: at most {P.MAX_STOP} stop strings", "stop")
        return end

    def stop_token_ids(self, i: int) -> int:
        flat = self.flat(i) if self.is_list(i) else None
        if flat is None:
            return self.other(i, "stop_token_ids")
        V = self.limits.vocab_size
        if flat[0] > V:
            raise ShapeError(f"stop_token_ids: {flat[0]} ids, more than the vocabulary's {V} "
                             "tokens", "stop_token_ids")
        return flat[1]


_Rule = Callable[[_Walker, int], int]
_SAMPLING: dict[str, _Rule] = {"stop": _Walker.stop, "stop_token_ids": _Walker.stop_token_ids}
_ROUTES: dict[str, dict[str, _Rule]] = {
    "/v1/completions": {"prompt": _Walker.prompt, **_SAMPLING},
    "/v1/chat/completions": {"messages": _Walker.messages, **_SAMPLING},
    "/tokenize": {"messages": _Walker.messages},
}
