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
from typing import Any

from mcserve import __version__
from mcserve.cli_args import (
    EXIT_USAGE,
    CLIError,
    first_line,
    non_negative_float,
    positive_int,
)

RANDOM_MODEL_SEED = 0


EXAMPLES = """examples:
  mcserve generate --prompt "Hello"           random untrained model (noise), no download
  mcserve generate MODEL_DIR --prompt "Hello"  a checkpoint directory or RWKV-7 .pth file
  mcserve serve MODEL_DIR --port 8000          OpenAI-compatible HTTP server
  mcserve eval ppl MODEL_DIR --data text.txt   perplexity with and without post-hoc MC

'mcserve COMMAND --help' describes each command's options."""


def build_parser() -> argparse.ArgumentParser:
    """The ``mcserve`` parser with its sub-commands (builds without importing torch)."""
    parser = argparse.ArgumentParser(
        prog="mcserve",
        description="Inference engine for recurrent language models with Memory Caching.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mcserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    gen = sub.add_parser(
        "generate", help="continue a prompt (prints the new text)",
        description="Continue a prompt through the engine and print the new text on stdout "
        "(a timing line goes to stderr). Without MODEL_DIR a small randomly initialised model "
        "(untrained, byte-level) is used, so the text is noise.",
    )
    gen.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                     help="checkpoint: a directory (mcserve's own; Mamba2 or Mamba from "
                     "transformers or mamba_ssm; fla-hub DeltaNet, Gated DeltaNet, GLA or "
                     "RWKV-7; docs/models.md) or a BlinkDL RWKV-7 .pth file; its tokenizer.json "
                     "is used when there is one (RWKV-7: the World tokenizer), else UTF-8 bytes "
                     "(default: a small random model)")
    gen.add_argument("--prompt", default="Hello", help="prompt text (default: %(default)r)")
    gen.add_argument("--max-tokens", type=positive_int, default=32, metavar="N",
                     help="new tokens to generate at most; generation stops earlier at the "
                     "end-of-sequence token (default: %(default)s)")
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                     help="sampling temperature; 0 is greedy (default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling seed for --temperature > 0 (default: the engine's seed, 0)")
    gen.set_defaults(func=cmd_generate)

    from mcserve.server.cli_serve import add_serve_parser

    add_serve_parser(sub)

    from mcserve.eval.cli import add_eval_parser

    add_eval_parser(sub)
    return parser


def _load(model_dir: str | None) -> tuple[Any, Any, str, bool]:
    """(model, tokenizer, description, has tokenizer.json) for MODEL_DIR, or the random model
    when None."""
    import torch

    from mcserve.config import ModelConfig
    from mcserve.engine.tokenizer import Tokenizer, load_tokenizer
    from mcserve.models.checkpoint import CheckpointError
    from mcserve.models.native import MCForCausalLM

    if model_dir is None:
        torch.manual_seed(RANDOM_MODEL_SEED)
        model = MCForCausalLM(ModelConfig()).eval()
        return model, Tokenizer.byte_level(), "random untrained model", False
    from mcserve.models.registry import load_model

    try:  # any supported checkpoint: mcserve's own, Mamba2 (transformers or mamba_ssm layout)
        model = load_model(model_dir)
        tok = load_tokenizer(model_dir)
    except (CheckpointError, ValueError, OSError) as e:
        raise CLIError(first_line(e)) from None
    return model.eval(), tok, str(model_dir), (Path(model_dir) / "tokenizer.json").is_file()


def _prompt_ids(model: Any, tok: Any, prompt: str, has_tokenizer: bool) -> list[int]:
    ids = tok.encode(prompt)
    vocab = model.config.vocab_size
    if not has_tokenizer and ids and max(ids) >= vocab:
        raise CLIError(f"the prompt has byte {max(ids)} but the model's vocab_size is {vocab} "
                       "and the checkpoint has no tokenizer.json")
    if not ids:
        bos = model.config.bos_token_id
        if bos is None:
            raise CLIError("the prompt is empty and the model has no bos_token_id")
        ids = [bos]
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    """``mcserve generate``: one prompt through the engine (``mcserve.engine.llm.LLM``)."""
    model, tok, what, has_tokenizer = _load(args.model_dir)
    ids = _prompt_ids(model, tok, args.prompt, has_tokenizer)

    from mcserve.config import EngineConfig
    from mcserve.engine.llm import LLM
    from mcserve.engine.llm_engine import LLMEngine
    from mcserve.engine.sampling import SamplingParams

    eos = model.config.eos_token_id
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, stop_token_ids=[eos] if eos is not None else None)
        config = EngineConfig(max_num_seqs=1, max_model_len=len(ids) + args.max_tokens)
        llm = LLM(engine=LLMEngine(config, model=model, tokenizer=tok, model_name=what))
        start = time.perf_counter()
        (out,) = llm.generate([ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    except ValueError as e:
        raise CLIError(first_line(e)) from None
    if out.error:
        raise CLIError(out.error)
    new = out.outputs[0].token_ids
    if hasattr(sys.stdout, "reconfigure"):  # never fail on a terminal that is not UTF-8
        sys.stdout.reconfigure(errors="replace")
    sys.stdout.write(llm.tokenizer.decode(new) + "\n")
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
