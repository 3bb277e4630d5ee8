"""``mcserve eval ppl``, ``mcserve eval passkey`` and ``mcserve eval calibrate-delta``.

Hook into the main CLI with ``add_eval_parser(subparsers)``; each subcommand sets
``func=cmd_eval_ppl`` / ``cmd_eval_passkey`` / ``cmd_eval_calibrate`` (``args -> exit status``).
Errors raise ``mcserve.cli_args.CLIError`` (one line on stderr, status 2).
``python -m mcserve.eval`` runs the same commands without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import sys

from mcserve.cli_args import (
    DEVICE_HELP,
    EXIT_USAGE,
    CLIError,
    check_device,
    delta_scale_arg,
    first_line,
    positive_int,
)

DEFAULT_LENGTHS = "512,1024,2048,4096"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="checkpoint directory: mcserve, transformers Mamba2 or mamba_ssm Mamba2")
    p.add_argument("--mc", default="post", metavar="SETTINGS",
                   help="comma-separated post-hoc MC settings VARIANT[:SEGMENT_LEN[:MODE"
                   "[:TOP_K]]] (variants: post, grm, ssc, loglinear, residual, none) and "
                   "reset[:SEGMENT_LEN]; SEGMENT_LEN defaults to the model's own segment length "
                   "when it uses MC, else its training length (max_position_embeddings), MODE "
                   "to independent for post and checkpoint otherwise; the model as is is always "
                   "evaluated; '' for no MC setting (default: %(default)s)")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="directory with tokenizer.json (default: MODEL's own tokenizer.json, "
                   "else UTF-8 bytes as token ids)")
    p.add_argument("--delta-scale", type=delta_scale_arg, metavar="S",
                   help="Mamba2 only: run every setting with delta' = s*delta: one number, one "
                   "per layer (comma-separated) or a JSON file (calibrate-delta's output) "
                   "(default: 1, the model as trained)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"),
                   help="weights and activations; on the CPU bfloat16 is the engine's: bfloat16 "
                   "weights for the large linear layers, float32 for the rest (default: "
                   "%(default)s)")
    p.add_argument("--quantization", default=None, choices=("int8",),
                   help="CPU: int8 weights for the large linear layers, as the engine's "
                   "--quantization (default: none)")
    p.add_argument("--device", default="cpu", help=f"{DEVICE_HELP} (default: %(default)s)")
    p.add_argument("--chunk", type=positive_int, default=1024, metavar="TOKENS",
                   help="tokens per forward call: memory versus speed, the results do not "
                   "depend on it (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=1, metavar="N",
                   help="windows (ppl) or prompts (passkey) run together (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="draw the results with matplotlib")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``eval`` (with ``ppl`` and ``passkey``) to an argparse subparsers object."""
    ev = subparsers.add_parser(
        "eval", help="perplexity and passkey retrieval, with and without post-hoc MC",
        description="Evaluate a checkpoint with and without post-hoc Memory Caching.")
    sub = ev.add_subparsers(dest="eval_command", metavar="EVAL", required=True)

    ppl = sub.add_parser(
        "ppl", help="perplexity versus context position",
        description="Perplexity of a text (or JSONL of texts) in windows of each length, per "
        "position bucket, for the model as is, each --mc setting and the segment-reset "
        "baseline (reset:C for each MC segment length C).")
    _common(ppl)
    ppl.add_argument("--data", required=True, metavar="FILE",
                     help=".txt, .jsonl of texts, or .bin of uint16 token ids")
    ppl.add_argument("--lengths", default=DEFAULT_LENGTHS, metavar="LIST",
                     help="comma-separated window lengths in tokens (default: %(default)s)")
    ppl.add_argument("--max-windows", type=positive_int, default=8, metavar="N",
                     help="windows per length at most (default: %(default)s)")
    ppl.add_argument("--buckets", metavar="EDGES",
                     help="position bucket edges, e.g. 0,256,512,1024 (default: 0, L/2, L, 2L, "
                     "4L, ... for the shortest length L)")
    ppl.add_argument("--no-reset", action="store_true",
                     help="do not add the segment-reset baselines")
    ppl.set_defaults(func=cmd_eval_ppl)

    pk = sub.add_parser(
        "passkey", help="S-NIAH-1 passkey retrieval accuracy by length and depth",
        description="A random 5-digit key hidden at a depth of filler text, then asked for; "
        "greedy decoding; accuracy per length x depth for the model as is and each --mc "
        "setting.")
    _common(pk)
    pk.add_argument("--lengths", default="256,512,1024,2048", metavar="LIST",
                    help="comma-separated prompt lengths in tokens (default: %(default)s)")
    pk.add_argument("--depths", default=DEFAULT_DEPTHS, metavar="LIST",
                    help="comma-separated needle depths in [0, 1]; 0 is the start of the filler "
                    "(default: %(default)s)")
    pk.add_argument("--trials", type=positive_int, default=5, metavar="N",
                    help="keys per length x depth cell (default: %(default)s)")
    pk.add_argument("--seed", type=int, default=0,
                    help="seed of the keys and filler (default: %(default)s)")
    pk.add_argument("--reset", action="store_true",
                    help="also run the segment-reset baseline for each MC segment length")
    pk.set_defaults(func=cmd_eval_passkey)

    cal = sub.add_parser(
        "calibrate-delta", help="pick per-layer Mamba2 delta scales for a longer context",
        description="Training-free context extension in MambaExtend's manner: search per-layer "
        "scales s of Mamba2's discretisation step (delta' = s*delta) on held-out data at the "
        "target length, first one shared scale over --grid, then layer by layer; no gradient "
        "steps. Writes a JSON file that --delta-scale (eval, serve) reads.")
    _common(cal)
    cal.set_defaults(mc="")
    cal.add_argument("--data", required=True, metavar="FILE",
                     help="held-out calibration data: .txt, .jsonl of texts, or .bin of uint16 "
                     "token ids (keep it apart from the evaluation data)")
    cal.add_argument("--length", type=positive_int, required=True, metavar="TOKENS",
                     help="target context length")
    cal.add_argument("--windows", type=positive_int, default=2, metavar="N",
                     help="windows of --length tokens (default: %(default)s)")
    cal.add_argument("--grid", default="0.25,0.35,0.5,0.7,1,1.4,2,2.8,4", metavar="LIST",
                     help="comma-separated candidate scales (default: %(default)s)")
    cal.add_argument("--passes", type=positive_int, default=1, metavar="N",
                     help="layer-by-layer sweeps after the shared scale (default: %(default)s)")
    cal.add_argument("--shared", action="store_true",
                     help="one scale for all layers only (no per-layer search)")
    cal.add_argument("--out", metavar="FILE",
                     help="write {'delta_scale': [...], ...} here (for --delta-scale FILE)")
    cal.set_defaults(func=cmd_eval_calibrate)
    return ev


def _prepare(args: argparse.Namespace) -> tuple:
    from mcserve.eval.common import default_segment_len, load, parse_settings

    check_device(args.device)
    try:
        model, tok = load(args.model, dtype=args.dtype, device=args.device,
                          tokenizer=args.tokenizer,
                          delta_scale=getattr(args, "delta_scale", None),
                          quantization=getattr(args, "quantization", None))
        with_reset = (not args.no_reset if hasattr(args, "no_reset")
                      else getattr(args, "reset", False))
        settings = parse_settings(args.mc, default_segment_len(model), with_reset=with_reset)
    except (ValueError, OSError) as e:
        raise CLIError(first_line(e)) from None
    return model, tok, settings


def _finish(args, report, format_table, plot) -> int:
    out = sys.stdout if args.json != "-" else sys.stderr
    print(format_table(report), file=out)
    if args.json:
        from mcserve.eval.common import write_json

        write_json(args.json, report)
    if args.plot:
        try:
            plot(report, args.plot, title=str(args.model))
        except ImportError:
            raise CLIError("--plot needs matplotlib (pip install matplotlib)") from None
    return 0


def _read_ids(path: str, model, tok) -> list[int]:
    from mcserve.eval.ppl import read_texts, read_token_file, tokenize_texts

    if str(path).endswith(".bin"):
        ids = read_token_file(path)
        if ids and max(ids) >= model.config.vocab_size:
            raise ValueError(f"{path} holds token id {max(ids)} but the model's "
                             f"vocab_size is {model.config.vocab_size}")
        return ids
    return tokenize_texts(read_texts(path), tok, model.config.vocab_size)


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from mcserve.eval.common import parse_int_list
    from mcserve.eval.ppl import evaluate_ppl, format_table, plot

    try:
        lengths = parse_int_list(args.lengths, "--lengths")
        buckets = (sorted({0, *[int(x) for x in args.buckets.split(",") if x.strip()]})
                   if args.buckets else None)
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    model, tok, settings = _prepare(args)
    try:
        ids = _read_ids(args.data, model, tok)
        report = evaluate_ppl(model, ids, lengths, settings, max_windows=args.max_windows,
                              batch_size=args.batch_size, chunk=args.chunk, buckets=buckets,
                              show_progress=not args.no_progress)
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    report.update(model=str(args.model), data=str(args.data), dtype=args.dtype,
                  quantization=args.quantization, device=args.device, delta_scale=_ds(args))
    return _finish(args, report, format_table, plot)


def _ds(args: argparse.Namespace):
    ds = getattr(args, "delta_scale", None)
    return list(ds) if isinstance(ds, tuple) else ds


def cmd_eval_passkey(args: argparse.Namespace) -> int:
    from mcserve.eval.common import parse_float_list, parse_int_list
    from mcserve.eval.passkey import evaluate_passkey, format_table, plot

    try:
        lengths = parse_int_list(args.lengths, "--lengths")
        depths = parse_float_list(args.depths, "--depths")
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    model, tok, settings = _prepare(args)
    try:
        report = evaluate_passkey(model, tok, lengths, depths, settings, trials=args.trials,
                                  seed=args.seed, chunk=args.chunk, batch_size=args.batch_size,
                                  show_progress=not args.no_progress)
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    report.update(model=str(args.model), dtype=args.dtype, device=args.device,
                  delta_scale=_ds(args))
    return _finish(args, report, format_table, plot)


def cmd_eval_calibrate(args: argparse.Namespace) -> int:
    from mcserve.eval.calibrate import calibrate_delta, format_result
    from mcserve.eval.common import parse_float_list, write_json

    try:
        grid = tuple(parse_float_list(args.grid, "--grid", lo=1e-6, hi=1e6))
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    model, tok, settings = _prepare(args)
    mc = [s for s in settings if s.kind != "as-is"]
    if len(mc) > 1:
        raise CLIError("calibrate-delta takes at most one --mc setting (the scales are "
                       "calibrated for it)")
    try:
        ids = _read_ids(args.data, model, tok)
        res = calibrate_delta(model, ids, args.length, setting=mc[0] if mc else None, grid=grid,
                              windows=args.windows, passes=args.passes, shared_only=args.shared,
                              chunk=args.chunk, batch_size=args.batch_size,
                              show_progress=not args.no_progress)
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    res.update(model=str(args.model), data=str(args.data), base_delta_scale=_ds(args))
    print(format_result(res), file=sys.stdout if args.json != "-" else sys.stderr)
    if args.out:
        write_json(args.out, res)
    if args.json:
        write_json(args.json, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mcserve.eval ppl|passkey|calibrate-delta ...`` (as ``mcserve eval ...``)."""
    parser = argparse.ArgumentParser(prog="mcserve")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_eval_parser(sub)
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except CLIError as e:
        print(f"mcserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
