"""``mcserve serve [MODEL]``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Wiring into the ``mcserve`` command (``mcserve/cli.py``)::

    from mcserve.server.cli_serve import add_serve_parser
    add_serve_parser(sub)   # sub = parser.add_subparsers(...)

``add_serve_parser`` only builds the argparse sub-command (no heavy imports); the sub-command's
``func`` is ``run_serve(args) -> int``. It can also run on its own:
``python -m mcserve.server.cli_serve [MODEL] [flags]``.

At start it logs one line (engine description and address) and prints a ready-to-paste curl
line on stdout. SIGTERM / Ctrl-C shut it down gracefully (running requests get
``--shutdown-timeout`` seconds, then are aborted) and the process exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
from typing import Any

from mcserve.cli import _non_negative_float, _positive_int

logger = logging.getLogger("mcserve.server")

API_KEY_ENV = "MCSERVE_API_KEY"
_SERVE_ONLY = {
    "host", "port", "api_key", "served_model_name", "max_waiting_requests", "max_body_bytes",
    "shutdown_timeout", "log_level", "access_log", "http", "loop", "func", "command",
    "_engine_flags",
}


def _port(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= val <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {val}")
    return val


def _add_engine_args_fallback(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineConfig`` field (when the engine has no ``add_engine_args``)."""
    from mcserve.config import EngineConfig

    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        ann = str(f.type).replace(" ", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"(engine) default: {default!r}"
        if ann == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        typ: Any = str
        if ann.startswith("int"):
            typ = int
        elif ann.startswith("float"):
            typ = float
        group.add_argument(flag, dest=f.name, type=typ, default=argparse.SUPPRESS,
                           help=help_text)


def _engine_arg_adder() -> Any:
    """The engine's own ``add_engine_args(parser)`` when ``mcserve.config`` has one, else None
    (then one flag per ``EngineConfig`` field). Only the light config module is imported here,
    so that building the ``mcserve`` parser never imports torch."""
    from mcserve import config

    return getattr(config, "add_engine_args", None)


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to ``subparsers``; returns its parser."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
        "streaming, metrics). Without MODEL the embedded default model is served.",
    )
    configure_serve_parser(p)
    return p


def configure_serve_parser(p: argparse.ArgumentParser) -> None:
    adder = _engine_arg_adder()
    if adder is not None:
        adder(p)
    else:
        _add_engine_args_fallback(p)
    p.set_defaults(_engine_flags="engine" if adder is not None else "fallback")
    if not any(a.dest == "model" for a in p._actions):
        p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                       help="checkpoint directory; default: the embedded default model")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=_port, default=8000,
                   help="port to bind; 0 picks a free one (default: %(default)s)")
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and "
                   f"/detokenize (default: ${API_KEY_ENV} if set, else no key)")
    s.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the engine's model name)")
    s.add_argument("--max-waiting-requests", type=_positive_int, default=512,
                   help="requests that may wait for the engine before new ones get 429 "
                   "(default: %(default)s)")
    s.add_argument("--max-body-bytes", type=_positive_int, default=4 * 2**20,
                   help="largest request body; larger ones get 413 (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=_non_negative_float, default=10.0,
                   help="seconds running requests get to finish on SIGTERM before they are "
                   "aborted (default: %(default)s)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(default: %(default)s)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP implementation (default: %(default)s: httptools when "
                   "installed)")
    s.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="uvicorn's event loop (default: %(default)s: uvloop when installed)")
    p.set_defaults(func=run_serve)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """``EngineConfig`` from the parsed flags (``EngineConfig.from_cli`` when it exists)."""
    from mcserve.config import EngineConfig

    from_cli = getattr(EngineConfig, "from_cli", None)
    if from_cli is not None and getattr(args, "_engine_flags", "engine") == "engine":
        return from_cli(args)
    names = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    kwargs = {k: v for k, v in vars(args).items() if k in names and k not in _SERVE_ONLY}
    return EngineConfig(**kwargs)


def _cli_error(message: str) -> Exception:
    try:
        from mcserve.cli import CLIError
    except ImportError:  # pragma: no cover
        return SystemExit(f"mcserve: error: {message}")
    return CLIError(message)


def curl_example(host: str, port: int, model: str, api_key: bool) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    body = json.dumps({"model": model, "prompt": "Memory caching", "max_tokens": 16})
    auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if api_key else ""
    return (f"curl http://{shown}:{port}/v1/completions -H 'Content-Type: application/json'"
            f"{auth} -d {shlex.quote(body)}")


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine and the app and serve until SIGTERM / Ctrl-C; returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    try:
        import uvicorn

        from mcserve.engine.llm_engine import LLMEngine
        from mcserve.server.app import build_app
    except ImportError as e:
        raise _cli_error(f"the server's dependency {e.name} is missing; reinstall mcserve "
                         "(pip install -e .)") from None
    try:
        config = engine_config_from_args(args)
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError, TypeError) as e:
        raise _cli_error(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    served = args.served_model_name or engine.model_name
    app = build_app(engine, api_key=api_key, served_model_name=served,
                    max_body_bytes=args.max_body_bytes,
                    max_waiting_requests=args.max_waiting_requests,
                    shutdown_grace_s=args.shutdown_timeout)
    describe = engine.describe()

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful shutdown, so the process would
            # die of SIGTERM; a graceful shutdown here exits 0 instead
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.should_exit:
                return
            port = args.port
            for server in getattr(self, "servers", []):
                for sock in server.sockets:
                    port = sock.getsockname()[1]
                    break
            logger.info("mcserve serving %s | %s | listening on http://%s:%d",
                        served, describe, args.host, port)
            print(curl_example(args.host, port, served, api_key is not None), flush=True)

    config_kw: dict[str, Any] = {
        "host": args.host, "port": args.port, "log_level": args.log_level,
        "access_log": bool(args.access_log), "lifespan": "on",
        "http": args.http, "loop": args.loop,
        "timeout_graceful_shutdown": args.shutdown_timeout,
    }
    server = _Server(uvicorn.Config(app, **config_kw))
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind; say it in one line
        if server.started:
            raise
    if not server.started:
        raise _cli_error(f"could not start the server on {args.host}:{args.port} "
                         "(see the error above)")
    logger.info("mcserve stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcserve serve")
    configure_serve_parser(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except SystemExit:
        raise
    except Exception as e:  # CLIError and friends: one line, status 2
        if type(e).__name__ == "CLIError":
            print(f"mcserve: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
