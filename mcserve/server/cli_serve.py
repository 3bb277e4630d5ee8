"""``mcserve serve [MODEL]``: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

Wiring into the ``mcserve`` command (``mcserve/cli.py``)::

    from mcserve.server.cli_serve import add_serve_parser
    add_serve_parser(sub)   # sub = parser.add_subparsers(...)

``add_serve_parser`` only builds the argparse sub-command (no heavy imports); the sub-command's
``func`` is ``run_serve(args) -> int``. It can also run on its own:
``python -m mcserve.server.cli_serve [MODEL] [flags]``.

At start it logs one line (engine description and address) and prints a ready-to-paste curl
line on stdout. SIGTERM / Ctrl-C shut it down gracefully and the process exits 0: the app drains
first (``/health`` and new requests answer 503, running requests get ``--shutdown-timeout``
seconds, the rest are aborted and answered: a 503, or an SSE error event and ``[DONE]``), and
only then does uvicorn close the connections. A second signal ends the grace period at once
(running requests are aborted and still answered); a third stops without waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import shlex
import sys
from typing import Any

from mcserve.cli_args import (
    DEVICE_HELP,
    EXIT_USAGE,
    CLIError,
    check_device,
    delta_scale_arg,
    first_line,
    non_negative_float,
    positive_int,
)

logger = logging.getLogger("mcserve.server")

API_KEY_ENV = "MCSERVE_API_KEY"

# help of the engine flags (one per EngineConfig field); a field missing here gets a generic one
_ENGINE_HELP = {
    "tokenizer": ("directory with tokenizer.json", "MODEL's own tokenizer.json, else UTF-8 bytes"),
    "max_num_seqs": ("sequences decoded together in one engine step", None),
    "max_num_batched_tokens": ("token budget of one engine step, prefill chunks and decodes "
                               "together",
                               None),
    "max_model_len": ("most tokens (prompt + generated) of one sequence", None),
    "num_state_blocks": ("device pool of cached segment states (each holds all layers)",
                         "sized from --max-num-seqs x --max-model-len, capped by "
                         "--state-cache-mib; none for variants that cache nothing"),
    "state_cache_mib": ("memory budget in MiB of the state cache (segment blocks, sized "
                        "automatically, and resume points)", None),
    "kv_cache_mib": ("hybrid models: memory budget in MiB of the attention layers' paged KV "
                     "cache", None),
    "kv_block_size": ("hybrid models: tokens per block of the paged KV cache", None),
    "num_kv_blocks": ("hybrid models: blocks of the paged KV cache", "--kv-cache-mib's worth"),
    "cpu_packed_weights": ("on CPU, run linear layers through oneDNN-packed copies of their "
                           "weights (faster, twice the weight memory)", None),
    "enforce_eager": ("on CUDA, run the decode step eagerly instead of replaying CUDA graphs "
                      "captured at start-up", None),
    "host_state_blocks": ("host-memory tier for the state blocks of preempted sequences "
                          "(0: recompute them instead)", None),
    "enable_prefix_caching": ("reuse cached states of a shared prompt prefix: segment blocks "
                              "and resume points", None),
    "checkpoint_interval": ("keep a resume point every N prompt tokens (0: only at request "
                            "ends, chat message ends and requested positions)",
                            "256 when the budget holds 32 of the model's states, else larger"),
    "host_state_cache_mib": ("host-memory tier (MiB) resume points spill to from a GPU "
                             "(unused on the CPU)", None),
    "state_cache_dir": ("directory of the disk tier of resume points: evicted ones are kept "
                        "there and found again after a restart", "no disk tier"),
    "state_cache_disk_gib": ("bound of the disk tier in GiB", None),
    "dtype": ("weights and activations", None),
    "quantization": ("CPU: int8 weights for the large linear layers (one scale per output "
                     "channel, quantized at load time; a quarter of float32's weight bytes "
                     "per token); int8", "none, float weights"),
    "device": (DEVICE_HELP, None),
    "seed": ("sampling seed of requests that bring none", None),
    "mc_variant": ("Memory Caching variant", "the checkpoint's config.json"),
    "mc_mode": ("Memory Caching mode", "the checkpoint's config.json"),
    "segment_len": ("Memory Caching segment length in tokens", "the checkpoint's config.json"),
    "mc_top_k": ("cached segments ssc reads per token", "the checkpoint's config.json"),
    "delta_scale": ("Mamba2 only: scale of the discretisation step, delta' = s*delta; one "
                    "number, one per layer (comma-separated) or a JSON file such as mcserve "
                    "eval calibrate-delta writes", "1, the model as trained"),
}
_METAVARS = {"tokenizer": "DIR", "state_cache_dir": "DIR", "dtype": "DTYPE", "device": "DEVICE",
             "delta_scale": "S"}


def _engine_choices() -> dict[str, tuple[str, ...]]:
    from mcserve import config

    return {"dtype": tuple(getattr(config, "_DTYPES", ("float32", "float64", "bfloat16"))),
            "mc_variant": config.VARIANTS, "mc_mode": config.MODES}


def _port(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= val <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {val}")
    return val


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineConfig`` field (but ``model``), in an "engine" group; a flag
    not given keeps the field's default."""
    from mcserve.config import EngineConfig

    choices = _engine_choices()
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        ann = str(f.type).replace(" ", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        what, none_means = _ENGINE_HELP.get(f.name, (f"engine setting {f.name}", None))
        if default is None:
            shown = none_means or "none"
        elif isinstance(default, bool):
            shown = "on" if default else "off"
        else:
            shown = str(default)
        help_text = f"{what} (default: {shown})"
        if ann == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue
        typ: Any = str
        if ann.startswith("int"):
            typ = int
        elif ann.startswith("float"):
            typ = float
        if f.name == "delta_scale":  # a number, a comma list or a JSON file
            typ = delta_scale_arg
        group.add_argument(flag, dest=f.name, type=typ, default=argparse.SUPPRESS,
                           choices=choices.get(f.name), help=help_text,
                           metavar=None if f.name in choices else _METAVARS.get(
                               f.name, "N" if typ is not str else "VALUE"))


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
    """The ``serve`` arguments on ``p``: MODEL, the engine flags and the server flags."""
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory: mcserve's own, transformers or mamba_ssm Mamba2 "
                   "(default: the embedded default model)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind; 0.0.0.0 for every interface (default: %(default)s)")
    s.add_argument("--port", type=_port, default=8000,
                   help="port to bind; 0 picks a free one (default: %(default)s)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes, /tokenize and "
                   f"/detokenize (default: ${API_KEY_ENV} if set, else no key; prefer the "
                   f"variable: a command line is visible to other users of the machine)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name in the API (default: the engine's model name)")
    s.add_argument("--max-waiting-requests", type=positive_int, default=512, metavar="N",
                   help="requests that may wait for the engine before new ones get 429 "
                   "(default: %(default)s)")
    s.add_argument("--max-body-bytes", type=positive_int, default=4 * 2**20, metavar="BYTES",
                   help="largest request body; larger ones get 413 (default: %(default)s)")
    s.add_argument("--body-timeout", type=non_negative_float, default=60.0, metavar="SECONDS",
                   help="most time a request body may take to arrive; a slower one gets 408 "
                   "(0: no limit; default: %(default)s)")
    s.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "json"],
                   help="how tool calls are read from answers: hermes (<tool_call> blocks), "
                   "json (the answer is a JSON call); auto: hermes when the chat template "
                   "mentions <tool_call>, else json (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=non_negative_float, default=10.0,
                   metavar="SECONDS",
                   help="seconds running requests get to finish on SIGTERM before they are "
                   "aborted (default: %(default)s)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="log verbosity (default: %(default)s)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP implementation (default: %(default)s: httptools when "
                   "installed)")
    s.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"],
                   help="uvicorn's event loop (default: %(default)s: uvloop when installed)")
    r = p.add_argument_group("scale-out (Ray Serve, docs/scale-out.md; needs mcserve[serve-ray])")
    r.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve N engine replicas behind one endpoint with Ray Serve, routed to "
                   "the replica holding a prompt's cached state (default: one process, no Ray)")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (ray start --head / --address) instead of "
                   "starting a local one")
    r.add_argument("--replica-threads", type=positive_int, default=1, metavar="N",
                   help="CPU threads (and Ray CPUs) per replica (default: %(default)s); a "
                   "CUDA replica also takes one GPU")
    r.add_argument("--router", default="state", choices=["state", "pow2"],
                   help="state: to the replica holding the longest cached prefix, the least "
                   "loaded one (with state migration) under imbalance; pow2: Ray Serve's "
                   "default (default: %(default)s)")
    p.set_defaults(func=run_serve)


def engine_config_from_args(args: argparse.Namespace) -> Any:
    """``EngineConfig`` from the parsed flags (MODEL and the engine group)."""
    from mcserve.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def _as_flag(message: str) -> str:
    """An ``EngineConfig`` error names the field (``max_num_seqs must be ...``): name the flag."""
    field, sep, rest = message.partition(" ")
    if sep and field.isidentifier() and field != field.upper():
        from mcserve.config import EngineConfig

        if field in {f.name for f in dataclasses.fields(EngineConfig)}:
            return "--" + field.replace("_", "-") + sep + rest
    return message


def _url_host(host: str) -> str:
    """``host`` as a client reaches it in a URL (a wildcard bind address becomes loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def curl_example(host: str, port: int, model: str, api_key_from: str | None) -> str:
    """A curl line for the running server. ``api_key_from`` is where the key came from:
    ``"env"`` (the line reads ``$MCSERVE_API_KEY``), ``"flag"`` (a placeholder for the
    ``--api-key`` value) or None (no key). The key itself is never printed."""
    body = json.dumps({"model": model, "prompt": "Memory caching", "max_tokens": 16})
    auth = ""
    if api_key_from == "env":
        auth = f' -H "Authorization: Bearer ${API_KEY_ENV}"'
    elif api_key_from is not None:
        auth = " -H 'Authorization: Bearer <your --api-key>'"
    return (f"curl http://{_url_host(host)}:{port}/v1/completions "
            f"-H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine and the app and serve until SIGTERM / Ctrl-C; returns the exit code."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    if getattr(args, "replicas", None):
        return _run_serve_ray(args)
    try:
        import uvicorn

        from mcserve.engine.llm_engine import LLMEngine
        from mcserve.server.app import DRAIN_SETTLE_S, build_app
    except ImportError as e:
        raise CLIError(f"the server's dependency {e.name} is missing; reinstall mcserve "
                       "(pip install -e .)") from None
    for flag, value, module in (("--http", args.http, "httptools"),
                                ("--loop", args.loop, "uvloop")):
        if value == module and importlib.util.find_spec(module) is None:
            raise CLIError(f"{flag} {value} needs the {module} package (pip install {module}), "
                           f"or leave {flag} at auto")
    try:
        config = engine_config_from_args(args)
    except (ValueError, TypeError) as e:
        raise CLIError(_as_flag(first_line(e))) from None
    check_device(config.device)
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError, TypeError) as e:
        raise CLIError(first_line(e)) from None
    if args.api_key is not None:
        api_key, key_from = args.api_key, "flag"
    else:
        api_key = os.environ.get(API_KEY_ENV) or None
        key_from = "env" if api_key is not None else None
    served = args.served_model_name or engine.model_name
    app = build_app(engine, api_key=api_key, served_model_name=served,
                    max_body_bytes=args.max_body_bytes,
                    max_waiting_requests=args.max_waiting_requests,
                    shutdown_grace_s=args.shutdown_timeout,
                    tool_call_parser=args.tool_call_parser,
                    body_timeout_s=args.body_timeout or None)
    describe = engine.describe()
    trained = getattr(getattr(engine, "model_config", None), "max_position_embeddings", None)
    if trained and config.max_model_len > trained:
        logger.warning("max_model_len=%d is longer than the %d tokens the model was trained at: "
                       "prompts and generations beyond %d tokens may degrade (set "
                       "--max-model-len to bound them)", config.max_model_len, trained, trained)

    class _Server(uvicorn.Server):
        drain_requested = False
        hurry_requested = False
        hurried = False
        drain_task: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            # a signal handler only sets flags: the next tick of main_loop (0.1 s) acts on them
            # from the event loop
            if not self.started or self.should_exit:
                super().handle_exit(sig, frame)
            elif not self.drain_requested:
                # drain while the listening socket stays open: /health answers 503 meanwhile
                self.drain_requested = True
            elif not self.hurry_requested:
                self.hurry_requested = True
            else:
                super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful shutdown, so the process would
            # die of SIGTERM; a graceful shutdown here exits 0 instead
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

        async def on_tick(self, counter: int) -> bool:
            if self.drain_requested and self.drain_task is None:
                self.drain_task = asyncio.ensure_future(self._drain())
            if self.hurry_requested and not self.hurried:
                self.hurried = True
                app.state.async_engine.abort_all("the server is shutting down; the request "
                                                 "was aborted")
            return await super().on_tick(counter)

        async def _drain(self) -> None:
            try:
                await app.state.drain()
            except Exception:  # noqa: BLE001 - a failed drain must still let the server stop
                logger.exception("draining failed")
            finally:
                self.should_exit = True

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
                        served, describe, _url_host(args.host), port)
            if key_from is None and args.host not in ("127.0.0.1", "localhost", "::1"):
                logger.warning("no API key: anyone who reaches %s:%d can use the model "
                               "(set $%s or --api-key)", args.host, port, API_KEY_ENV)
            logger.info("ready; an example request (on stdout):")
            print(curl_example(args.host, port, served, key_from), flush=True)

    config_kw: dict[str, Any] = {
        "host": args.host, "port": args.port, "log_level": args.log_level,
        "access_log": bool(args.access_log), "lifespan": "on",
        "http": args.http, "loop": args.loop,
        # by the time uvicorn shuts down, the drain has answered every request; this bound is
        # for a second signal, which skips the drain: the engine's grace, then a margin for the
        # handlers of the aborted requests to write their answer
        "timeout_graceful_shutdown": args.shutdown_timeout + DRAIN_SETTLE_S,
    }
    server = _Server(uvicorn.Config(app, **config_kw))
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot bind; say it in one line
        if server.started:
            raise
    if not server.started:
        raise CLIError(f"could not start the server on {args.host}:{args.port} "
                         "(see the error above)")
    logger.info("mcserve stopped")
    return 0


def _run_serve_ray(args: argparse.Namespace) -> int:
    """``--replicas N``: the same API, flags, errors and drain, over Ray Serve replicas."""
    try:
        from mcserve.server.ray import run_serve_ray
    except ImportError as e:
        raise CLIError(f"--replicas needs Ray Serve ({e.name} is missing): pip install "
                       "'mcserve[serve-ray]'") from None
    try:
        config = engine_config_from_args(args)
    except (ValueError, TypeError) as e:
        raise CLIError(_as_flag(first_line(e))) from None
    check_device(config.device)
    if args.api_key is not None:
        api_key, key_from = args.api_key, "flag"
    else:
        api_key = os.environ.get(API_KEY_ENV) or None
        key_from = "env" if api_key is not None else None

    def ready(port: int, served: str) -> None:
        logger.info("ready on http://%s:%d; an example request (on stdout):",
                    _url_host(args.host), port)
        print(curl_example(args.host, port, served, key_from), flush=True)

    return run_serve_ray(args, config, api_key=api_key, ready=ready)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcserve serve")
    configure_serve_parser(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except CLIError as e:
        print(f"mcserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
