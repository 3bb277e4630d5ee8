"""``bench/structured.py --quick``: constrained and plain decode of the same requests in one
run; the JSON has both kinds' rounds, every round decoded the same number of tokens, and the
target is printed, not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance")

ROOT = Path(__file__).resolve().parents[1]


def test_structured_quick(tmp_path):
    out = tmp_path / "structured.json"
    # MCSERVE_CPU_KERNELS=0: the bench's code paths are under test, not the C++ decode kernels,
    # whose first build alone would take most of a minute
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MCSERVE_CPU_KERNELS": "0"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "structured.py"), "--quick",
                        "--threads", "1", "--streams", "4", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["args"]["quick"] and data["args"]["new_tokens"] == 32
    for kind in ("plain", "constrained"):
        rounds = data["rounds"][kind]
        assert len(rounds) == data["args"]["repeats"] == 2
        for row in rounds:
            # the bench checks that every request made all its tokens; the timed ones are those
            # after the prefill's first
            assert 0 < row["tokens"] <= 4 * 31 and row["tokens_per_s"] > 0
    assert all(row["fill_ms_per_step"] > 0 for row in data["rounds"]["constrained"])
    assert data["rounds"]["plain"][0]["fill_ms_per_step"] is None
    # the ratio: the median of each constrained round against the plain round before it
    pairs = [c["tokens_per_s"] / p["tokens_per_s"]
             for p, c in zip(data["rounds"]["plain"], data["rounds"]["constrained"])]
    assert data["paired_ratios"] == pytest.approx(pairs)
    assert 0 < data["ratio"] == pytest.approx(sum(pairs) / 2)
    assert {t["pass"] for t in data["targets"]} <= {True, False}
    assert "Targets (printed, not asserted)" in r.stdout
    assert "| decode" in r.stdout and "bitmask fill ms/step" in r.stdout
    assert data["model"]["name"] == "default" and data["model"]["vocab_size"] == 4096


def test_bpe_tokenizer_has_real_subwords_that_constrain(tmp_path):
    """``--model mamba2-130m``'s vocabulary (``baselines.bpe_tokenizer``, here 600 tokens): a
    byte-level BPE with multi-byte sub-words that round-trips text, and llguidance compiles a
    schema over it through the engine's tokenizer."""
    sys.path.insert(0, str(ROOT / "bench"))
    from baselines import bpe_tokenizer
    from tokenizers import Tokenizer as HFTokenizer

    from mcserve.engine.sampling_params import StructuredOutputsParams
    from mcserve.engine.structured import StructuredOutputs
    from mcserve.engine.tokenizer import Tokenizer

    bpe_tokenizer(600, tmp_path / "tokenizer.json")
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == 600
    text = '{"id": 12, "name": "def __init__(self):\\n"}'
    enc = hf.encode(text)
    assert hf.decode(enc.ids) == text and len(enc.ids) < len(text.encode())
    so = StructuredOutputs(Tokenizer.from_dir(tmp_path), 600)
    matcher = so.matcher(StructuredOutputsParams(json={"type": "object"}))
    assert so.fill([matcher]).shape == (1, so.words)
