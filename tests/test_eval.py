"""``mcserve eval ppl`` and ``mcserve eval passkey`` end to end on tiny random models."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from mcserve.config import ModelConfig
from mcserve.eval.cli import main
from mcserve.eval.common import EvalModel, parse_settings
from mcserve.eval.passkey import build_prompt
from mcserve.eval.ppl import default_buckets, window_nll
from mcserve.models.mamba2 import Mamba2Config, Mamba2MCForCausalLM
from mcserve.models.native import MCForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    torch.manual_seed(0)
    native = MCForCausalLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2,
                                       head_dim=16, mc_variant="none",
                                       max_position_embeddings=32))
    native.save_pretrained(root / "native")
    torch.manual_seed(1)
    mamba = Mamba2MCForCausalLM(Mamba2Config(vocab_size=256, d_model=16, n_layers=1, n_heads=2,
                                             head_dim=16, state_size=8))
    with torch.no_grad():  # transformers-like init: decays spread over heads, small steps
        for blk in mamba.layers:
            blk.mixer.A_log.copy_(torch.log(torch.arange(1, 3.0)))
            blk.mixer.dt_bias.fill_(-3.0)
    mamba.save_pretrained(root / "mamba2")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while memory caching helps".split()
    text = " ".join(rng.choice(words) for _ in range(120))
    (root / "data.txt").write_text(text)
    (root / "data.jsonl").write_text("\n".join(json.dumps({"text": text[i:i + 150]})
                                               for i in range(0, len(text), 150)))
    return root


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


@pytest.mark.parametrize("model,data", [("native", "data.txt"), ("mamba2", "data.jsonl")])
def test_eval_ppl_end_to_end(models, model, data, tmp_path, capsys):
    out_json = tmp_path / "ppl.json"
    table = _run([
        "ppl", str(models / model), "--data", str(models / data), "--lengths", "16,48",
        "--mc", "post:16,grm:8:checkpoint,post:64", "--max-windows", "2", "--chunk", "5",
        "--json", str(out_json), "--no-progress",
    ], capsys)
    report = json.loads(out_json.read_text())
    names = [s["name"] for s in report["settings"]]
    assert names == ["as-is", "post:16:independent", "grm:8:checkpoint", "post:64:independent",
                     "reset:16", "reset:8", "reset:64"]
    assert report["lengths"] == [16, 48]
    assert report["buckets"] == [[0, 8], [8, 16], [16, 32], [32, 48]]
    assert len(report["results"]) == len(names) * 2
    by = {(r["setting"], r["length"]): r for r in report["results"]}
    for r in report["results"]:
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
        assert r["windows"] == 2
        assert len(r["bucket_ppl"]) == 4
    assert by[("as-is", 16)]["bucket_ppl"][2:] == [None, None]
    # a segment as long as the window changes nothing; a reset at 64 never happens
    for L in (16, 48):
        assert by[("post:64:independent", L)]["ppl"] == pytest.approx(by[("as-is", L)]["ppl"],
                                                                       rel=1e-5)
        assert by[("reset:64", L)]["ppl"] == pytest.approx(by[("as-is", L)]["ppl"], rel=1e-5)
    # the first segment is the same for every setting; later ones differ
    assert by[("reset:16", 48)]["bucket_ppl"][:2] == pytest.approx(
        by[("as-is", 48)]["bucket_ppl"][:2], rel=1e-5)
    assert by[("reset:16", 48)]["ppl"] != pytest.approx(by[("as-is", 48)]["ppl"], rel=1e-6)
    # the table has a header, a rule and one row per result
    lines = table.strip().splitlines()
    assert lines[0].split()[:3] == ["setting", "length", "ppl"]
    assert len(lines) == 2 + len(report["results"])


def test_eval_passkey_end_to_end(models, tmp_path, capsys):
    out_json = tmp_path / "pk.json"
    table = _run([
        "passkey", str(models / "mamba2"), "--lengths", "260,300", "--depths", "0,0.5,1",
        "--trials", "2", "--mc", "post:64", "--reset", "--batch-size", "2", "--json",
        str(out_json), "--no-progress",
    ], capsys)
    report = json.loads(out_json.read_text())
    assert [s["name"] for s in report["settings"]] == ["as-is", "post:64:independent",
                                                       "reset:64"]
    assert len(report["results"]) == 3 * 2 * 3
    for r in report["results"]:
        assert r["trials"] == 2 and 0 <= r["accuracy"] <= 1
        assert r["accuracy"] == r["correct"] / 2 and len(r["completions"]) == 2
    assert len(table.strip().splitlines()) == 2 + 3 * 2


def test_eval_plots(models, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _run(["ppl", str(models / "native"), "--data", str(models / "data.txt"), "--lengths", "16,32",
          "--mc", "post:8", "--max-windows", "1", "--plot", str(tmp_path / "ppl.png"),
          "--no-progress"], capsys)
    _run(["passkey", str(models / "native"), "--lengths", "260", "--depths", "0,1", "--trials",
          "1", "--mc", "", "--plot", str(tmp_path / "pk.png"), "--no-progress"], capsys)
    for name in ("ppl.png", "pk.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_errors(models, tmp_path, capsys):
    rc = main(["ppl", str(models / "native"), "--data", str(models / "data.txt"), "--lengths",
               "100000", "--no-progress"])
    assert rc == 2 and "fewer than" in capsys.readouterr().err
    rc = main(["ppl", str(tmp_path / "nope"), "--data", str(models / "data.txt")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    rc = main(["ppl", str(models / "native"), "--data", str(models / "data.txt"), "--mc",
               "bogus:16"])
    assert rc == 2 and "bogus" in capsys.readouterr().err
    rc = main(["passkey", str(models / "native"), "--lengths", "20"])
    assert rc == 2 and "too short" in capsys.readouterr().err


def test_settings_and_helpers(models):
    s = parse_settings("post,ssc:32:independent:3,loglinear:16,reset,none:8", 64,
                       with_reset=True)
    assert [x.name for x in s] == ["as-is", "post:64:independent", "ssc:32:independent:3",
                                   "loglinear:16:checkpoint", "reset:64", "none", "reset:32",
                                   "reset:16"]
    assert s[5].overrides() == {"mc_variant": "none"}
    assert s[1].overrides() == {"mc_variant": "post", "segment_len": 64,
                                "mc_mode": "independent"}
    with pytest.raises(ValueError, match="loglinear needs mode checkpoint"):
        parse_settings("loglinear:16:independent", 64, with_reset=False)
    assert default_buckets([512, 1024, 4096]) == [0, 256, 512, 1024, 2048, 4096]

    from mcserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.byte_level()
    ids = build_prompt(tok, 400, 0.5, 12345)
    assert len(ids) == 400
    text = tok.decode(ids)
    assert "The pass key is 12345." in text and text.endswith("The pass key is")
    assert build_prompt(tok, 400, 0.0, 12345)[:len(ids) // 2] != ids[:len(ids) // 2]

    # chunking and the reset EvalModel: any chunk size gives the same NLL
    from mcserve.models.registry import load_model

    model = load_model(models / "mamba2")
    x = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(1))
    for reset in (None, 8):
        a = window_nll(model, x, y, EvalModel(model, reset_every=reset, chunk=30))
        b = window_nll(model, x, y, EvalModel(model, reset_every=reset, chunk=3))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
