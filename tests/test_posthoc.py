"""Δ scaling of imported Mamba2 models (``delta_scale``) and its calibration command.

A tiny random transformers ``Mamba2ForCausalLM`` is saved to a temporary directory; nothing is
downloaded and every test runs in a few seconds on CPU.
"""

from __future__ import annotations

import argparse
import json
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Mamba2Config as HFConfig  # noqa: E402
from transformers import Mamba2ForCausalLM as HFMamba2  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from mcserve.cli_args import parse_delta_scale  # noqa: E402
from mcserve.config import EngineConfig  # noqa: E402
from mcserve.eval.calibrate import calibrate_delta  # noqa: E402
from mcserve.eval.cli import add_eval_parser  # noqa: E402
from mcserve.eval.common import Setting  # noqa: E402
from mcserve.models.mamba2 import Mamba2Config  # noqa: E402
from mcserve.models.registry import load_model  # noqa: E402

VOCAB = 64


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.manual_seed(0)
    hf = HFMamba2(HFConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_heads=4,
                           head_dim=8, state_size=8, n_groups=1, conv_kernel=4, chunk_size=8,
                           max_position_embeddings=16, bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)).eval()
    path = tmp_path_factory.mktemp("mamba2")
    hf.save_pretrained(path)
    return hf, path


def ids(T: int = 29, batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(seed))


def hf_logits_scaled(hf: HFMamba2, x: torch.Tensor, scales: list[float]) -> torch.Tensor:
    """transformers' logits with softplus(dt + dt_bias) multiplied by scales[layer]: its
    module-level ``F.softplus`` is swapped for a scaled one while each mixer runs."""
    current = {"s": 1.0}
    real = modeling_mamba2.F
    fake = types.SimpleNamespace(**{n: getattr(real, n) for n in dir(real)
                                    if not n.startswith("__")})
    fake.softplus = lambda t, *a, **k: real.softplus(t, *a, **k) * current["s"]
    hooks = []
    for i, layer in enumerate(hf.backbone.layers):
        def pre(_mod, _args, _kw=None, i=i):
            current["s"] = scales[i]
        hooks.append(layer.mixer.register_forward_pre_hook(pre))
    modeling_mamba2.F = fake
    try:
        with torch.no_grad():
            return hf(x).logits
    finally:
        modeling_mamba2.F = real
        for h in hooks:
            h.remove()


def test_scale_one_is_identity(ckpt):
    _, path = ckpt
    x = ids()
    base = load_model(path)
    with torch.no_grad():
        want, _ = base(x)
        for ds in (1.0, [1.0], [1.0, 1.0, 1.0]):
            got, _ = load_model(path, mc_overrides={"delta_scale": ds})(x)
            assert torch.equal(got, want)


@pytest.mark.parametrize("scales", [[0.5, 0.5, 0.5], [0.3, 1.0, 2.5]])
def test_scaled_equals_transformers_with_scaled_softplus(ckpt, scales):
    hf, path = ckpt
    x = ids()
    want = hf_logits_scaled(hf, x, scales)
    plain = hf_logits_scaled(hf, x, [1.0, 1.0, 1.0])
    assert not torch.allclose(want, plain, atol=1e-3)  # the patch does change the model
    model = load_model(path, mc_overrides={"delta_scale": scales})
    assert model.config.delta_scale == tuple(scales)
    with torch.no_grad():
        got, _ = model(x)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4


def test_scaled_decode_matches_prefill(ckpt):
    """Token-by-token decoding (where the unscaled model uses a fused C++ block) agrees with
    the parallel forward under a scale."""
    _, path = ckpt
    model = load_model(path, mc_overrides={"delta_scale": [2.0, 0.5, 1.5]})
    x = ids(T=12, batch=1)
    with torch.no_grad():
        full, _ = model(x)
        state, steps = None, []
        for t in range(x.shape[1]):
            logits, state = model(x[:, t:t + 1], state)
            steps.append(logits)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_delta_scale_with_mc_and_engine(ckpt):
    _, path = ckpt
    model = load_model(path, mc_overrides={"delta_scale": 0.5, "mc_variant": "post",
                                           "segment_len": 8})
    assert model.config.delta_scale == (0.5, 0.5, 0.5) and model.config.mc_variant == "post"
    again = model.with_mc(mc_variant="none")
    assert again.config.delta_scale == (0.5, 0.5, 0.5)  # MC changes keep the scale
    from mcserve.engine.llm import LLM
    from mcserve.engine.sampling import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=6)
    prompt = [[int(t) for t in ids(T=10, batch=1)[0]]]
    scaled = LLM(str(path), delta_scale=[2.0, 0.5, 1.5]).generate(prompt, p)[0]
    assert scaled.outputs[0].token_ids == _greedy(
        load_model(path, mc_overrides={"delta_scale": [2.0, 0.5, 1.5]}), prompt[0], 6)


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    logits, state = model(torch.tensor([prompt]))
    out = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]]), state)
    return out


def test_config_validation(tmp_path):
    assert Mamba2Config(n_layers=3, delta_scale=2).delta_scale == (2.0, 2.0, 2.0)
    assert Mamba2Config(n_layers=2, delta_scale=[1, 3]).delta_scale == (1.0, 3.0)
    for bad in ([1.0, 2.0], 0.0, -1.0, float("nan"), "x", [True, 1.0, 1.0]):
        with pytest.raises(ValueError, match="delta_scale"):
            Mamba2Config(n_layers=3, delta_scale=bad)
    with pytest.raises(ValueError, match="delta_scale"):
        EngineConfig(delta_scale=0.0)
    with pytest.raises(ValueError, match="delta_scale"):
        EngineConfig(delta_scale=[])
    assert EngineConfig(delta_scale=[1, 2]).mc_overrides() == {"delta_scale": (1.0, 2.0)}
    assert "delta_scale" not in EngineConfig().mc_overrides()


def test_parse_flag(tmp_path):
    assert parse_delta_scale("1.5") == 1.5
    assert parse_delta_scale("1,2.5, 0.5") == (1.0, 2.5, 0.5)
    f = tmp_path / "ds.json"
    f.write_text(json.dumps({"delta_scale": [0.5, 2.0], "ppl": 3.0}))
    assert parse_delta_scale(str(f)) == (0.5, 2.0)
    f.write_text("1.25")
    assert parse_delta_scale(str(f)) == 1.25
    for bad in ("abc", "0", "1,-2", "", str(tmp_path / "missing.json")):
        with pytest.raises(ValueError, match="delta_scale"):
            parse_delta_scale(bad)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_eval_parser(sub)
    args = parser.parse_args(["eval", "ppl", "M", "--data", "d.txt", "--delta-scale", "2,1"])
    assert args.delta_scale == (2.0, 1.0)
    with pytest.raises(SystemExit):
        parser.parse_args(["eval", "ppl", "M", "--data", "d.txt", "--delta-scale", "-1"])
    from mcserve.server.cli_serve import add_engine_args, engine_config_from_args

    sp = argparse.ArgumentParser()
    add_engine_args(sp)
    assert engine_config_from_args(sp.parse_args(["--delta-scale", "0.5"])).delta_scale == 0.5
    with pytest.raises(SystemExit):
        sp.parse_args(["--delta-scale", "nope"])


def test_native_model_refuses_delta_scale(tmp_path):
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR

    with pytest.raises(ValueError, match="delta_scale"):
        load_model(DEFAULT_MODEL_DIR, mc_overrides={"delta_scale": 2.0})


def test_calibrate_finds_the_planted_scale(ckpt):
    """Data sampled from the model run at scales (2, 1, 0.5): the search recovers a setting
    at least as good as the planted one, and better than scale 1."""
    _, path = ckpt
    planted = load_model(path, mc_overrides={"delta_scale": [2.0, 1.0, 0.5]})
    g = torch.Generator().manual_seed(1)
    seq, state = [3], None
    logits, state = planted(torch.tensor([seq]), None)
    with torch.no_grad():
        for _ in range(200):
            nxt = int(torch.multinomial(logits[0, -1].softmax(-1), 1, generator=g))
            seq.append(nxt)
            logits, state = planted(torch.tensor([[nxt]]), state)
    base = load_model(path)
    res = calibrate_delta(base, seq, 64, grid=(0.5, 1.0, 2.0), windows=3, show_progress=False)
    assert res["ppl"] <= res["ppl_shared"] <= res["ppl_unscaled"]
    assert res["ppl"] < res["ppl_unscaled"]
    assert len(res["delta_scale"]) == 3
    assert res["evaluations"] == len(res["history"])
    shared = calibrate_delta(base, seq, 64, grid=(0.5, 2.0), windows=2, shared_only=True,
                             setting=Setting("mc", variant="post", segment_len=16,
                                             mode="independent"), show_progress=False)
    assert len(set(shared["delta_scale"])) == 1 and shared["setting"] == "post:16:independent"


def test_calibrate_cli(ckpt, tmp_path, capsys):
    _, path = ckpt
    data = tmp_path / "calib.bin"
    import numpy as np

    np.asarray(ids(T=300, batch=1)[0].tolist(), dtype="<u2").tofile(data)
    out = tmp_path / "ds.json"
    from mcserve.eval.cli import main

    rc = main(["calibrate-delta", str(path), "--data", str(data), "--length", "64",
               "--grid", "0.5,1,2", "--windows", "2", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["delta_scale"]) == 3 and res["ppl"] <= res["ppl_unscaled"]
    assert "--delta-scale" in capsys.readouterr().out
    rc = main(["ppl", str(path), "--data", str(data), "--lengths", "32,64", "--mc", "",
               "--delta-scale", str(out), "--no-progress", "--json", str(tmp_path / "p.json")])
    assert rc == 0
    rep = json.loads((tmp_path / "p.json").read_text())
    assert rep["delta_scale"] == res["delta_scale"]
