"""``ReplicaHeaderMiddleware``: the ingress's ``x-mcserve-replica`` response header, from
the replicas that served the HTTP request (``SERVED_BY``, filled by the ingress's streams)."""

from __future__ import annotations

import contextvars

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["REPLICA_HEADER", "SERVED_BY", "ReplicaHeaderMiddleware"]

REPLICA_HEADER = "x-mcserve-replica"

# replicas that served the HTTP request being handled (ReplicaHeaderMiddleware sets the list,
# RemoteRequestStream appends to it)
SERVED_BY: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "mcserve_served_by", default=None)


class ReplicaHeaderMiddleware:
    """Adds ``x-mcserve-replica: <id>[,<id>...]`` to responses that an engine replica
    served (a response starts only after its requests were accepted)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        served: list[str] = []
        token = SERVED_BY.set(served)

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start" and served:
                names = ",".join(dict.fromkeys(served))
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REPLICA_HEADER.encode(), names.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            SERVED_BY.reset(token)
