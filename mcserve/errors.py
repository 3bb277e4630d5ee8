"""Typed errors shared by the engine and the server.

The engine raises ``InvalidRequestError`` for anything wrong with a request; it is a
``ValueError`` (so plain Python callers can catch it as one) that names the request field at
fault in ``param``. The server maps it to an HTTP 400 in the OpenAI shape with that ``param``,
without reading the message text.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt, sampling parameters, MC overrides) the engine refuses.

    ``param`` is the OpenAI-facing field name at fault (``"prompt"``, ``"max_tokens"``,
    ``"top_p"``, ``"mc_top_k"``...), or None when no single field is to blame.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param
