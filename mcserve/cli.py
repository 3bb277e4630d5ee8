"""The ``mcserve`` command line.

``mcserve generate [MODEL_DIR]`` continues a prompt. Without MODEL_DIR it uses a small *randomly
initialised* model (``ModelConfig()`` with a fixed seed, byte-level ids), so its output is noise;
it exercises the whole model path without any download. With MODEL_DIR it loads any checkpoint the
engine serves (``mcserve.models.registry``: mcserve's own, Mamba2) and its ``tokenizer.json`` when
there is one (bytes otherwise).

Generated text goes to stdout, the timing line to stderr. Errors print one line to stderr and exit
with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mcserve import __version__

EXIT_USAGE = 2
RANDOM_MODEL_SEED = 0


class CLIError(Exception):
    """An error reported to the user as one line, exit status 2."""


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (the random model's vocabulary)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        if ids and max(ids) >= self.vocab_size:
            raise CLIError(
                f"the prompt has byte {max(ids)} but the model's vocab_size is {self.vocab_size} "
                "and the checkpoint has no tokenizer.json"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, file: Path):
        from tokenizers import Tokenizer

        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise CLIError(f"{file} is not a valid tokenizer file: {_first_line(e)}") from None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _positive_int(text: str) -> int:
    try:
        val = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if val < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {val}")
    return val


def _non_negative_float(text: str) -> float:
    try:
        val = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not val >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return val


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcserve",
        description="Inference engine for recurrent language models with Memory Caching.",
    )
    parser.add_argument("--version", action="version", version=f"mcserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate", help="continue a prompt",
        description="Continue a prompt. Without MODEL_DIR a small randomly initialised model "
        "(untrained, byte-level) is used, so the text is noise.",
    )
    gen.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                     help="checkpoint directory (config.json + model.safetensors); "
                     "default: a small random model")
    gen.add_argument("--prompt", default="Hello", help="prompt text (default: %(default)r)")
    gen.add_argument("--max-tokens", type=_positive_int, default=32,
                     help="new tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.set_defaults(func=cmd_generate)

    from mcserve.server.cli_serve import add_serve_parser

    add_serve_parser(sub)

    from mcserve.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return parser


def _load(model_dir: str | None):
    """(model, tokenizer, description) for MODEL_DIR, or the random model when None."""
    import torch

    from mcserve.config import ModelConfig
    from mcserve.models.checkpoint import CheckpointError
    from mcserve.models.native import MCForCausalLM

    if model_dir is None:
        torch.manual_seed(RANDOM_MODEL_SEED)
        model = MCForCausalLM(ModelConfig()).eval()
        return model, ByteTokenizer(model.config.vocab_size), "random untrained model"
    from mcserve.models.registry import load_model

    try:  # any supported checkpoint: mcserve's own, Mamba2 (transformers or mamba_ssm layout)
        model = load_model(model_dir)
    except (CheckpointError, ValueError, OSError) as e:
        raise CLIError(_first_line(e)) from None
    tok_file = Path(model_dir) / "tokenizer.json"
    tok = HFTokenizer(tok_file) if tok_file.is_file() else ByteTokenizer(model.config.vocab_size)
    return model.eval(), tok, str(model_dir)


def cmd_generate(args: argparse.Namespace) -> int:
    model, tok, what = _load(args.model_dir)
    ids = tok.encode(args.prompt)
    if not ids:
        bos = model.config.bos_token_id
        if bos is None:
            raise CLIError("the prompt is empty and the model has no bos_token_id")
        ids = [bos]
    start = time.perf_counter()
    try:
        new = model.generate(
            ids, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
            eos_token_id=model.config.eos_token_id,
        )
    except ValueError as e:
        raise CLIError(_first_line(e)) from None
    elapsed = time.perf_counter() - start
    if hasattr(sys.stdout, "reconfigure"):  # never fail on a terminal that is not UTF-8
        sys.stdout.reconfigure(errors="replace")
    sys.stdout.write(tok.decode(new) + "\n")
    sys.stdout.flush()
    rate = len(new) / elapsed if elapsed > 0 else float("inf")
    print(
        f"[mcserve] {what}: {len(ids)} prompt + {len(new)} new tokens in {elapsed:.2f} s "
        f"({rate:.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except CLIError as e:
        print(f"mcserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
