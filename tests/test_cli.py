"""Tests for the ``mcserve`` command line (``mcserve.cli``).

A few cases run the real console entry point in a subprocess (exit codes, no traceback, the
documented command); the rest call ``main(argv)`` in-process, which is faster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mcserve
from mcserve.cli import main
from mcserve.config import ModelConfig
from mcserve.models.native import MCForCausalLM

SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, head_dim=16, segment_len=8)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mcserve.cli", *args], capture_output=True, text=True, timeout=300,
    )


def greedy(model: MCForCausalLM, ids: list[int], n: int) -> list[int]:
    """Reference greedy continuation: a full forward pass over the whole sequence per token."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq]))
            seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids):]


def assert_one_line_error(proc_or_err: str, *phrases: str) -> None:
    lines = proc_or_err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("mcserve: error: ")
    assert "Traceback" not in proc_or_err
    for phrase in phrases:
        assert phrase in lines[0]


@pytest.fixture
def word_checkpoint(tmp_path: Path) -> Path:
    """A small random checkpoint with a word-level tokenizer.json."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["[UNK]", "hello", "world", "memory", "caching"] + [f"w{i}" for i in range(59)]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    torch.manual_seed(0)
    path = tmp_path / "ckpt"
    MCForCausalLM(SMALL).save_pretrained(path, tokenizer_files={"tokenizer.json": tok.to_str()})
    return path


# --- subprocess: the real entry point ----------------------------------------------------------


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"mcserve {mcserve.__version__}"


def test_generate_random_model_documented_command() -> None:
    proc = run_cli("generate", "--prompt", "Hello", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1
    assert "tokens/s" in proc.stderr and "random untrained model" in proc.stderr
    assert "8 new tokens" in proc.stderr


def test_missing_model_dir_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run_cli("generate", str(tmp_path / "missing"), "--prompt", "hi")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert_one_line_error(proc.stderr, "does not exist", "missing")


def test_no_command_prints_help_and_exits_2() -> None:
    proc = run_cli()
    assert proc.returncode == 2
    assert "generate" in proc.stderr


# --- in-process ---------------------------------------------------------------------------------


def test_random_generation_is_deterministic(capsys) -> None:
    outs = []
    for _ in range(2):
        assert main(["generate", "--prompt", "Memory caching", "--max-tokens", "6"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


def test_random_model_matches_library(capsys) -> None:
    """The CLI's random model is ModelConfig() built after torch.manual_seed(0), byte ids; its
    greedy continuation is the argmax of the model's own forward pass."""
    assert main(["generate", "--prompt", "abc", "--max-tokens", "5"]) == 0
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig()).eval()
    new = greedy(model, list(b"abc"), 5)
    expected = bytes(new).decode("utf-8", errors="replace")
    assert capsys.readouterr().out == expected + "\n"


def test_sampling_with_seed_is_reproducible(capsys) -> None:
    args = ["generate", "--prompt", "x", "--max-tokens", "6", "--temperature", "1.0", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_checkpoint_with_tokenizer(word_checkpoint: Path, capsys) -> None:
    assert main(["generate", str(word_checkpoint), "--prompt", "hello world",
                 "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(word_checkpoint / "tokenizer.json"))
    model = MCForCausalLM.from_pretrained(word_checkpoint)
    new = greedy(model.eval(), tok.encode("hello world").ids, 4)
    assert out == tok.decode(new) + "\n"
    assert "2 prompt + 4 new tokens" in err


def test_checkpoint_without_tokenizer_uses_bytes(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    model = MCForCausalLM(SMALL.replace(vocab_size=256))
    model.save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "hey", "--max-tokens", "3"]) == 0
    new = greedy(model.eval(), list(b"hey"), 3)
    assert capsys.readouterr().out == bytes(new).decode("utf-8", errors="replace") + "\n"


def test_generate_from_a_mamba2_checkpoint(tmp_path: Path, capsys) -> None:
    # any checkpoint the engine serves, not only mcserve's own: a transformers Mamba2 directory
    tf = pytest.importorskip("transformers", reason="building the Mamba2 needs 'transformers'")
    torch.manual_seed(0)
    hf = tf.Mamba2ForCausalLM(tf.Mamba2Config(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8,
        num_heads=8, n_groups=1, expand=2, conv_kernel=4, bos_token_id=None, eos_token_id=None))
    hf.save_pretrained(tmp_path)
    assert main(["generate", str(tmp_path), "--prompt", "hey", "--max-tokens", "4"]) == 0
    with torch.no_grad():
        want = hf.generate(torch.tensor([list(b"hey")]), max_new_tokens=4, do_sample=False,
                           pad_token_id=0)[0, 3:].tolist()
    assert capsys.readouterr().out == bytes(want).decode("utf-8", errors="replace") + "\n"


def test_prompt_outside_small_byte_vocab(tmp_path: Path, capsys) -> None:
    MCForCausalLM(SMALL).save_pretrained(tmp_path)  # vocab 64, no tokenizer.json
    assert main(["generate", str(tmp_path), "--prompt", "hello"]) == 2
    assert_one_line_error(capsys.readouterr().err, "vocab_size is 64", "no tokenizer.json")


def test_empty_prompt_without_bos(capsys) -> None:
    assert main(["generate", "--prompt", ""]) == 2
    assert_one_line_error(capsys.readouterr().err, "prompt is empty")


def test_bad_checkpoint_exits_2(word_checkpoint: Path, capsys) -> None:
    cfg = json.loads((word_checkpoint / "config.json").read_text())
    cfg["memory"] = "lstm"
    (word_checkpoint / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", str(word_checkpoint)]) == 2
    assert_one_line_error(capsys.readouterr().err, "config.json", "memory='lstm'")


def test_corrupt_weights_exits_2(word_checkpoint: Path, capsys) -> None:
    (word_checkpoint / "model.safetensors").write_bytes(b"\x00" * 10)
    assert main(["generate", str(word_checkpoint)]) == 2
    assert_one_line_error(capsys.readouterr().err, "model.safetensors")


def test_bad_tokenizer_exits_2(word_checkpoint: Path, capsys) -> None:
    (word_checkpoint / "tokenizer.json").write_text("{not json")
    assert main(["generate", str(word_checkpoint)]) == 2
    assert_one_line_error(capsys.readouterr().err, "tokenizer.json")


@pytest.mark.parametrize("args", [["--max-tokens", "0"], ["--max-tokens", "x"],
                                  ["--temperature", "-1"]])
def test_bad_arguments_exit_2(args: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", *args])
    assert info.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_import_is_light() -> None:
    """``import mcserve`` and ``mcserve --version`` do not load torch."""
    code = "import sys, mcserve, mcserve.cli; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.strip() == "False", proc.stderr


# --- through the engine, shared errors, help and serve start-up ---------------------------------


def test_generate_goes_through_the_engine(monkeypatch, capsys) -> None:
    from mcserve.engine.llm import LLM
    from mcserve.models.base import RecurrentLM

    def no_model_loop(*args, **kwargs):
        raise AssertionError("mcserve generate must not run the model's own loop")

    monkeypatch.setattr(RecurrentLM, "generate", no_model_loop, raising=False)
    calls = []
    real = LLM.generate

    def spy(self, prompts, params=None, **kw):
        calls.append((prompts, params, kw))
        return real(self, prompts, params, **kw)

    monkeypatch.setattr(LLM, "generate", spy)
    assert main(["generate", "--prompt", "ab", "--max-tokens", "3", "--temperature", "0.5",
                 "--seed", "1"]) == 0
    (prompts, params, kw), = calls
    assert prompts == [list(b"ab")] and kw == {"use_tqdm": False}
    assert params.max_tokens == 3 and params.temperature == 0.5 and params.seed == 1
    assert "2 prompt + 3 new tokens" in capsys.readouterr().err


def test_cli_modules_share_one_error_type() -> None:
    import mcserve.cli_args
    import mcserve.eval.cli
    import mcserve.server.cli_serve

    assert mcserve.cli.CLIError is mcserve.cli_args.CLIError
    assert mcserve.eval.cli.CLIError is mcserve.server.cli_serve.CLIError is mcserve.cli.CLIError


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@pytest.mark.parametrize("device,phrase", [
    ("tpu", "is not a device"),
    ("mps", "cpu or cuda only"),
    pytest.param("cuda", "use --device cpu", marks=NO_CUDA),
    pytest.param("cuda:1", "use --device cpu", marks=NO_CUDA),
])
@pytest.mark.parametrize("command", ["serve", "eval"])
def test_bad_device_is_one_line(command: str, device: str, phrase: str, tmp_path: Path,
                                capsys) -> None:
    argv = ["serve", "--device", device] if command == "serve" else \
        ["eval", "ppl", str(tmp_path), "--data", str(tmp_path / "x.txt"), "--device", device]
    assert main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, f"--device {device!r}", phrase)


def test_serve_engine_flag_errors_name_the_flag(capsys) -> None:
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert_one_line_error(capsys.readouterr().err, "--max-num-seqs must be a positive integer")


def test_serve_missing_http_implementation_is_one_line(capsys) -> None:
    import importlib.util

    if importlib.util.find_spec("httptools") is not None:
        pytest.skip("httptools is installed here")
    assert main(["serve", "--http", "httptools"]) == 2
    assert_one_line_error(capsys.readouterr().err, "pip install httptools")


def test_curl_example_never_prints_the_key() -> None:
    from mcserve.server.cli_serve import curl_example

    flag = curl_example("0.0.0.0", 8000, "m", "flag")
    assert "http://127.0.0.1:8000/v1/completions" in flag
    assert "Bearer <your --api-key>" in flag and "$MCSERVE_API_KEY" not in flag
    assert 'Bearer $MCSERVE_API_KEY"' in curl_example("127.0.0.1", 1, "m", "env")
    assert "Authorization" not in curl_example("127.0.0.1", 1, "m", None)
    assert "http://[::1]:1/" in curl_example("::1", 1, "m", None)


@pytest.mark.parametrize("argv", [[], ["serve"], ["eval"], ["eval", "ppl"], ["eval", "passkey"],
                                  ["generate"]])
def test_help_reads_well(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    assert "(engine)" not in out and "default: None" not in out
    if not argv:
        assert "examples:" in out and "mcserve serve" in out
    if argv == ["serve"]:
        assert "--dtype {float32,float64,bfloat16}" in out and "--tokenizer DIR" in out
        assert "the checkpoint's config.json" in out
