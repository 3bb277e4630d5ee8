"""The recall experiments (experiments/recall/: mqar.py, niah.py, ablations.py): task generators
and a smoke run.

The generators must produce exactly the task they claim (Zoology's MQAR; S-NIAH-1 passkey), and
the whole pipeline (build, train through the parallel forward, evaluate, tables, JSON) must run.
Accuracy is not asserted here (``mqar.py --quick`` does that, at a larger budget).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

RECALL = Path(__file__).resolve().parent.parent / "experiments" / "recall"
sys.path.insert(0, str(RECALL))

import recall_common as rc  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("T,P,V", [(64, 4, 64), (256, 64, 256), (128, 8, 256)])
def test_mqar_layout(T, P, V):
    x, y = rc.mqar_batch(16, T, P, V, _gen(0))
    assert x.shape == y.shape == (16, T)
    assert x.dtype == y.dtype == torch.long
    assert int(x.min()) >= 0 and int(x.max()) < V
    keys, vals = x[:, 0:2 * P:2], x[:, 1:2 * P:2]
    assert bool(((keys >= 1) & (keys < V // 2)).all()), "keys must come from the lower half"
    assert bool(((vals >= V // 2) & (vals < V)).all()), "values must come from the upper half"
    for b in range(16):
        assert len(set(keys[b].tolist())) == P  # distinct keys (drawn without replacement)
        assert len(set(vals[b].tolist())) == P
        kv = dict(zip(keys[b].tolist(), vals[b].tolist()))
        mask = y[b] != rc.IGNORE
        pos = mask.nonzero().flatten().tolist()
        assert len(pos) == P, "one answer per pair"
        assert all(p >= 2 * P for p in pos), "no loss inside the key-value context"
        # the answer at a query is the value paired with the key sitting there
        for p in pos:
            assert int(y[b, p]) == kv[int(x[b, p])]
        assert sorted(int(x[b, p]) for p in pos) == sorted(kv), "every key is queried once"
        assert bool((y[b][~mask] == rc.IGNORE).all())


def test_mqar_deterministic_and_seeded():
    a = rc.mqar_batch(8, 128, 16, 256, _gen(3))
    b = rc.mqar_batch(8, 128, 16, 256, _gen(3))
    c = rc.mqar_batch(8, 128, 16, 256, _gen(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_mqar_power_law_gaps_favour_short():
    _, y = rc.mqar_batch(256, 256, 8, 256, _gen(0))
    pos = (y != rc.IGNORE).nonzero()[:, 1].float() - 16  # offsets into the query region
    assert float((pos < 60).float().mean()) > 0.5


def test_mqar_rejects_bad_sizes():
    with pytest.raises(ValueError):
        rc.mqar_batch(2, 64, 17, 256, _gen(0))  # 4·pairs > seq_len
    with pytest.raises(ValueError):
        rc.mqar_batch(2, 1024, 40, 64, _gen(0))  # more pairs than keys


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0, None])
def test_passkey_layout(depth):
    T, n = 96, 5
    x, y = rc.passkey_batch(8, T, _gen(1), n_digits=n, depth=depth)
    assert x.shape == y.shape == (8, T)
    for b in range(8):
        mask = y[b] != rc.IGNORE
        assert mask.nonzero().flatten().tolist() == list(range(T - n, T))
        digits = y[b, T - n:]
        assert bool(((digits >= rc.PK_DIGIT0) & (digits < rc.PK_DIGIT0 + 10)).all())
        assert int(x[b, T - n]) == rc.PK_QUERY
        assert torch.equal(x[b, T - n + 1:], digits[:-1])  # teacher forcing
        at = (x[b] == rc.PK_NEEDLE).nonzero().flatten().tolist()
        assert len(at) == 1
        a = at[0]
        assert torch.equal(x[b, a + 1:a + 1 + n], digits)
        assert int(x[b, a + 1 + n]) == rc.PK_END
    a = rc.passkey_batch(4, T, _gen(5), depth=depth)
    b = rc.passkey_batch(4, T, _gen(5), depth=depth)
    assert torch.equal(a[0], b[0])


def test_transformer_is_causal():
    torch.manual_seed(0)
    m = rc.build_model({"family": "attention", "d_model": 64, "variant": "-"})
    x = torch.randint(0, 256, (2, 20))
    x2 = x.clone()
    x2[:, 12:] = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        a, _ = m(x)
        b, _ = m(x2)
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_xonly_gates_hook_trains():
    import ablations

    torch.manual_seed(0)
    m = rc.build_model({"family": "linear", "variant": "grm", "d_model": 64,
                        "mc": {"segment_len": 8}, "hook": "ablations:xonly_gates"})
    assert isinstance(m.layers[0].mixer.memory, ablations.XOnlyGates)
    x = torch.randint(0, 256, (2, 40))
    logits, _ = m(x)
    logits.sum().backward()
    assert m.layers[0].mixer.seg_emb.grad is not None
    assert float(m.layers[0].mixer.seg_emb.grad.abs().sum()) > 0


def test_mqar_smoke(tmp_path):
    import mqar

    t0 = time.perf_counter()
    out = tmp_path / "mqar.json"
    data = mqar.main(["--families", "linear", "--variants", "none", "grm", "--seq-lens", "32",
                      "--pairs", "4", "--steps", "6", "--batch", "8", "--eval-n", "16",
                      "--vocab", "64", "--segment-len", "8", "--out", str(out),
                      "--plot", str(tmp_path / "mqar.png")])
    assert time.perf_counter() - t0 < 60
    saved = json.loads(out.read_text())
    names = [r["spec"]["name"] for r in saved["results"]]
    assert names == ["attention/-/d64/T32/s0", "linear/none/d64/T32/s0", "linear/grm/d64/T32/s0"]
    for r in data["results"]:
        assert "error" not in r, r.get("traceback")
        assert 0.0 <= r["eval"]["acc"]["4"] <= 1.0
        assert r["steps_done"] == 6
    assert (tmp_path / "mqar.jsonl").exists()


def test_mqar_records_deep_memory_init_norms():
    """Deep-memory runs record W^init's spectral norms (how far training grew them); a diverged
    run records None instead of failing; other families record nothing."""
    import mqar

    spec = {"family": "titans", "variant": "none", "d_model": 64, "vocab": 64,
            "mc": {"segment_len": 16}}
    m = rc.build_model(spec)
    with torch.no_grad():
        m.layers[0].mixer.w1_init[1] *= 5.0
    rec = mqar.winit_norms(m)["winit_spectral"]
    assert len(rec) == m.config.n_layers
    w1 = m.layers[0].mixer.w1_init.detach()
    assert rec[0][0] == pytest.approx(float(torch.linalg.matrix_norm(w1, ord=2).max()), abs=1e-3)
    assert rec[0][0] > 4 * rec[1][0]  # the scaled head is the largest
    with torch.no_grad():
        m.layers[1].mixer.w2_init[0, 0, 0] = float("nan")
    assert mqar.winit_norms(m)["winit_spectral"][1][1] is None
    assert mqar.winit_norms(rc.build_model({"family": "linear", "variant": "none",
                                            "d_model": 64})) == {}


def _fake_run(spec):
    return {"spec": spec, "value": spec["value"]}


def test_run_many_keeps_other_invocations_results(tmp_path):
    """Two invocations sharing one --jsonl (e.g. two runs started side by side) must not lose
    each other's finished runs; a spec run again without --resume is rerun, the newest wins."""
    jsonl = tmp_path / "runs.jsonl"
    rc.run_many(_fake_run, [{"name": "a", "value": 1}], jsonl)
    rc.run_many(_fake_run, [{"name": "b", "value": 2}], jsonl)
    again = rc.run_many(_fake_run, [{"name": "a", "value": 3}], jsonl)
    assert [r["value"] for r in again] == [3]
    assert {k: r["value"] for k, r in rc.load_done(jsonl).items()} == {"a": 3, "b": 2}
    kept = rc.run_many(_fake_run, [{"name": "a", "value": 4}, {"name": "b", "value": 5}], jsonl,
                       resume=True)
    assert [r["value"] for r in kept] == [3, 2]  # nothing rerun


def test_mqar_head_dim_seeds_modes(tmp_path):
    """--head-dim, --seeds and --mc-modes: names, configs, the mean-over-seeds verdicts, and
    --plot-from redraws from the JSON alone."""
    import mqar

    m = rc.build_model({"family": "linear", "variant": "none", "d_model": 64, "head_dim": 16})
    assert (m.config.n_heads, m.config.head_dim) == (4, 16)
    out = tmp_path / "cap.json"
    data = mqar.main(["--families", "linear", "--variants", "none", "grm", "--seq-lens", "32",
                      "--pairs", "4", "--steps", "3", "--batch", "4", "--eval-n", "8",
                      "--vocab", "64", "--segment-len", "8", "--head-dim", "16",
                      "--seeds", "0", "1", "--mc-modes", "checkpoint", "independent",
                      "--out", str(out), "--plot", str(tmp_path / "cap.png")])
    names = [r["spec"]["name"] for r in data["results"]]
    assert names == [f"{m}/d64k16/T32/s{s}" for s in (0, 1) for m in (
        "attention/-", "linear/none", "linear/grm", "linear/grm+ind")]
    for r in data["results"]:
        assert "error" not in r, r.get("traceback")
    ind = [r for r in data["results"] if "+ind" in r["spec"]["name"]]
    assert all(r["spec"]["mc"]["mc_mode"] == "independent" for r in ind)
    specs = mqar.make_specs(mqar.parse_args(["--families", "linear", "titans", "--variants", "none",
                                             "--family-lr", "titans=3e-3", "--lr", "0.01"]))
    assert {s["family"]: s["lr"] for s in specs} == {"attention": 0.01, "linear": 0.01,
                                                     "titans": 3e-3}
    for bad in ("titans", "titan=3e-3", "titans=fast", "titans=-1"):
        with pytest.raises(ValueError, match="--family-lr"):
            mqar.make_specs(mqar.parse_args(["--family-lr", bad]))
    v = data["targets"]["d64/T32/linear/k16"]
    if "acc" in v:  # only when attention reached 90% (not in 3 steps)
        assert set(v["acc"]) == {"none", "grm", "grm+ind"}
    again = mqar.main(["--plot-from", str(out), "--plot", str(tmp_path / "again.png")])
    assert len(again["results"]) == 8


def test_niah_posthoc_settings_match_their_definitions():
    """niah.py's post-hoc rows: within one segment post-hoc MC and the segment reset are
    the plain model; past it the reset restarts the memory (first C positions unchanged, later
    ones not), and every post-hoc setting plus its reset baseline is built."""
    import niah

    torch.manual_seed(0)
    m = rc.build_model({"family": "linear", "variant": "none", "d_model": 64}).eval()
    x = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        ref, _ = m(x)
        sets = {s.name: s for s in niah.posthoc_settings(niah.POSTHOC, 16)}
        assert set(sets) == {"post:8:independent", "post:16:independent", "post:32:independent",
                             "post:16:checkpoint", "grm:16:checkpoint", "ssc:16:checkpoint:2",
                             "ssc:16:checkpoint:1",
                             "reset:8", "reset:16", "reset:32"}
        for name in ("post:16:independent", "post:16:checkpoint", "grm:16:checkpoint"):
            out, _ = niah._Setting(m, sets[name])(x)
            assert torch.allclose(out[:, :16], ref[:, :16], atol=1e-5), name
            assert not torch.allclose(out[:, 20:], ref[:, 20:], atol=1e-4), name
        out, _ = niah._Setting(m, sets["reset:16"])(x)
        assert torch.allclose(out[:, :16], ref[:, :16], atol=1e-5)
        assert not torch.allclose(out[:, 16:], ref[:, 16:], atol=1e-4)
        long_reset = niah._Setting(m, niah.posthoc_settings("post:64", 64)[-1])
        assert torch.allclose(long_reset(x)[0], ref, atol=1e-5)  # reset:64 never fires at T=40


def test_niah_smoke(tmp_path):
    import niah

    out = tmp_path / "niah.json"
    args = ["--variants", "none", "--no-attention", "--train-len", "32", "--lengths", "32", "48",
            "--depths", "0.5", "--digits", "2", "--steps", "4", "--batch", "4", "--eval-n", "4"]
    data = niah.main(args + ["--posthoc", "post:{T},grm:{T/2}", "--out", str(out),
                             "--save-dir", str(tmp_path / "w")])
    (r,) = data["results"]
    assert "error" not in r, r.get("traceback")
    assert set(r["posthoc"]) == {"post:32:independent", "grm:16:checkpoint", "reset:32",
                                 "reset:16"}
    for e in r["posthoc"].values():
        assert set(e["acc"]) == {"32", "48"}
    assert json.loads(out.read_text())["results"][0]["posthoc"].keys() == r["posthoc"].keys()
    # the saved weights re-evaluate to the same numbers, under other settings too
    again = niah.main(args + ["--posthoc", "ssc:{T}::1", "--out", str(tmp_path / "again.json"),
                              "--load-dir", str(tmp_path / "w")])
    (r2,) = again["results"]
    assert r2["eval"]["acc"] == r["eval"]["acc"] and r2["loaded_from"].endswith(".pt")
    assert set(r2["posthoc"]) == {"ssc:32:checkpoint:1", "reset:32"}
    with pytest.raises(FileNotFoundError, match="--load-dir"):
        niah.run_niah(dict(r2["spec"], load_dir=str(tmp_path / "nothing")))


def test_niah_deep_memory_posthoc_segment_lengths():
    """Deep memories update in inner chunks: post-hoc segments must be multiples of them, and
    a bad --posthoc is refused before any training, naming the setting."""
    import niah

    spec = {"name": "dla/none/T24", "family": "dla", "variant": "none", "d_model": 64,
            "train_len": 24, "posthoc": "post:{T}", "steps": 10_000, "lr": 1e-3, "seed": 0}
    with pytest.raises(ValueError, match=r"post:24:independent.*inner_chunk \(16\)"):
        niah.run_niah(spec)
    torch.manual_seed(0)
    m = rc.build_model({"family": "dla", "variant": "none", "d_model": 64}).eval()
    (st, reset) = niah.posthoc_settings("post:{T}", 32)
    x = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        ref, _ = m(x)
        out, _ = niah._Setting(m, st)(x)
    assert torch.allclose(out[:, :32], ref[:, :32], atol=1e-5)
    assert reset.name == "reset:32"


def test_niah_eval_dtype_float64_copies_the_model(capsys):
    """--eval-dtype float64 evaluates a float64 copy (the trained model, its saved weights and
    training stay float32) whose logits match float32's on a short input; an unknown dtype is
    refused by the parser, naming the flag."""
    import niah

    torch.manual_seed(0)
    m = rc.build_model({"family": "dla", "variant": "none", "d_model": 64}).eval()
    assert niah._in_eval_dtype(m, {}) is m
    m64 = niah._in_eval_dtype(m, {"eval_dtype": "float64"})
    assert m64 is not m and next(m64.parameters()).dtype == torch.float64
    assert next(m.parameters()).dtype == torch.float32
    x = torch.randint(0, 256, (2, 37))
    with torch.no_grad():
        ref, _ = m(x)
        out, _ = m64(x)
    assert out.dtype == torch.float64
    assert torch.allclose(out.float(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(SystemExit):
        niah.main(["--eval-dtype", "float16"])
    assert "--eval-dtype" in capsys.readouterr().err


def test_niah_eval_dtype_runs_end_to_end(tmp_path):
    import niah

    args = ["--families", "dla", "--variants", "none", "--no-attention", "--train-len", "32",
            "--lengths", "32", "64", "--depths", "0.5", "--digits", "2", "--steps", "3",
            "--batch", "4", "--eval-n", "4", "--posthoc", "post:{T}", "--eval-dtype", "float64",
            "--out", str(tmp_path / "n.json")]
    (r,) = niah.main(args)["results"]
    assert "error" not in r, r.get("traceback")
    assert r["spec"]["eval_dtype"] == "float64"
    assert set(r["eval"]["acc"]) == {"32", "64"}
    assert set(r["posthoc"]["post:32:independent"]["acc"]) == {"32", "64"}


def test_state_growth_reads_niah_weights(tmp_path):
    """state_growth.py measures the online memory of niah.py's saved models: one value
    per --every tokens for each memory tensor of each layer, finite for a fresh tiny model."""
    import niah
    import state_growth

    jsonl = tmp_path / "n.jsonl"
    niah.main(["--families", "dla", "--variants", "none", "--no-attention", "--train-len", "32",
               "--lengths", "32", "--depths", "0.5", "--digits", "2", "--steps", "2",
               "--batch", "4", "--eval-n", "2", "--posthoc", "", "--out",
               str(tmp_path / "n.json"), "--jsonl", str(jsonl), "--save-dir", str(tmp_path / "w")])
    data = state_growth.main(["--load-dir", str(tmp_path / "w"), "--jsonl", str(jsonl),
                              "--length", "64", "--every", "32", "--batch", "2",
                              "--out", str(tmp_path / "g.json")])
    (r,) = data["results"]
    assert r["name"] == "dla/none/T32" and data["tokens"] == [32, 64]
    assert set(r["max_abs"]) == {"L0.W1", "L0.W2", "L1.W1", "L1.W2"}
    assert all(len(v) == 2 and all(x is not None and x > 0 for x in v)
               for v in r["max_abs"].values())
    with pytest.raises(ValueError, match="--length"):
        state_growth.main(["--load-dir", str(tmp_path / "w"), "--jsonl", str(jsonl),
                           "--length", "50", "--every", "32"])
    with pytest.raises(ValueError, match="--names"):
        state_growth.main(["--load-dir", str(tmp_path / "w"), "--jsonl", str(jsonl),
                           "--names", "dla/grm/T32"])


def test_results_are_not_clobbered_while_a_run_is_going(tmp_path, monkeypatch):
    """A long recall run replaces its --out only when it finishes: killed half way, the previous
    results are still there (the scripts used to write {} there first to resolve the path)."""
    import niah
    import recall_common as common

    assert common.results_path("x.json") == common.RESULTS_DIR / "x.json"
    assert not (common.RESULTS_DIR / "x.json").exists()
    assert common.results_path(tmp_path / "y.json") == tmp_path / "y.json"
    out = tmp_path / "niah.json"
    out.write_text('{"previous": true}\n')
    seen = []
    real = niah.run_many

    def spy(*args, **kwargs):
        seen.append(json.loads(out.read_text()))
        return real(*args, **kwargs)

    monkeypatch.setattr(niah, "run_many", spy)
    niah.main(["--variants", "none", "--no-attention", "--train-len", "32", "--lengths", "32",
               "--depths", "0.5", "--digits", "2", "--steps", "2", "--batch", "4",
               "--eval-n", "2", "--posthoc", "", "--out", str(out)])
    assert seen == [{"previous": True}]
    assert json.loads(out.read_text())["results"][0]["spec"]["name"] == "linear/none/T32"


def test_readout_scale_wraps_only_inside_the_block(tmp_path):
    """readout_scale.py: content scale 1 leaves the model's logits as they were, scale 0
    leaves only the identity term (the memory's content is gone: the output no longer depends
    on tokens far back), the wrap is undone after the block, and the script reports a finite
    ratio per layer and head and an accuracy per scale and length."""
    import niah
    import readout_scale
    import state_growth

    jsonl = tmp_path / "n.jsonl"
    niah.main(["--families", "titans", "--variants", "none", "--no-attention", "--train-len",
               "32", "--lengths", "32", "--depths", "0.5", "--digits", "2", "--steps", "2",
               "--batch", "4", "--eval-n", "2", "--posthoc", "", "--out",
               str(tmp_path / "n.json"), "--jsonl", str(jsonl), "--save-dir", str(tmp_path / "w")])
    spec = state_growth.saved_models(str(tmp_path / "w"), str(jsonl), None)["titans/none/T32"]
    model = state_growth.load_saved(str(tmp_path / "w"), "titans/none/T32", spec)
    x = torch.randint(0, 16, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)[0]
        with readout_scale.scaled_content(model, 1.0):
            same = model(x)[0]
        with readout_scale.scaled_content(model, 0.0):
            a = model(x)[0]
            y = x.clone()
            y[:, :20] = (y[:, :20] + 1) % 16  # change only tokens far outside the short conv
            b = model(y)[0]
        after = model(x)[0]
    torch.testing.assert_close(same, ref, rtol=0, atol=0)
    torch.testing.assert_close(after, ref, rtol=0, atol=0)
    torch.testing.assert_close(a[:, -1], b[:, -1])  # no memory left to carry token 0..19
    with torch.no_grad():  # ... which the unscaled memory does carry
        assert not torch.allclose(ref[:, -1], model(y)[0][:, -1])
    # under post-hoc MC (cached memories read through readout_mix) the same two properties
    mixed = niah._Setting(model, niah.posthoc_settings("post:16", 32)[0])
    with torch.no_grad():
        ref = mixed(x)[0]
        with readout_scale.scaled_content(mixed.inner, 1.0):
            torch.testing.assert_close(mixed(x)[0], ref, rtol=1e-6, atol=1e-6)
        with readout_scale.scaled_content(mixed.inner, 0.0):
            torch.testing.assert_close(mixed(x)[0][:, -1], mixed(y)[0][:, -1])
        assert not torch.allclose(ref[:, -1], mixed(y)[0][:, -1])
    data = readout_scale.main(["--load-dir", str(tmp_path / "w"), "--jsonl", str(jsonl),
                               "--lengths", "32", "48", "--scales", "1", "0.5", "--eval-n", "2",
                               "--batch", "2", "--posthoc", "post:16", "--out",
                               str(tmp_path / "r.json")])
    (r,) = data["results"]
    # post-hoc post with segments of 16: 2 and 3 segments at the end, run as defined (x1) and
    # with the contents summed (x number of segments)
    post = r["posthoc"]["post:16:independent"]
    assert {T: sorted(v) for T, v in post.items()} == {"32": ["1.0", "2.0"], "48": ["1.0", "3.0"]}
    assert all(0 <= e <= 1 for v in post.values() for e in v.values())
    assert set(r["exact"]) == {"1.0", "0.5"} and set(r["exact"]["1.0"]) == {"32", "48"}
    heads = model.layers[0].mixer.H
    assert [len(lay) for lay in r["ratio"]["32"]] == [heads, heads]  # 2 layers
    assert all(0 <= v < float("inf") for lay in r["ratio"]["48"] for v in lay)
    with pytest.raises(ValueError, match="--tail"):
        readout_scale.main(["--load-dir", str(tmp_path / "w"), "--jsonl", str(jsonl),
                            "--tail", "0"])


def test_mqar_dtype_float64_trains_in_float64(tmp_path, monkeypatch):
    """--dtype float64 trains the model in float64 (dla's memory overflows float32 past T = 64),
    labels the runs +f64 so they do not collide with float32 runs in a shared --jsonl, and leaves
    float32 specs as they were (no dtype key: older result lines still resume)."""
    import mqar

    seen = []
    real = mqar.train_loop

    def spy(model, *args, **kwargs):
        seen.append(next(model.parameters()).dtype)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(mqar, "train_loop", spy)
    argv = ["--families", "dla", "--deep-variants", "none", "grm", "--no-attention",
            "--seq-lens", "32", "--pairs", "4", "--steps", "2", "--variant-steps", "--batch", "4",
            "--eval-n", "4", "--vocab", "64", "--segment-len", "16"]
    data = mqar.main(argv + ["--dtype", "float64", "--out", str(tmp_path / "f64.json")])
    assert seen == [torch.float64, torch.float64]
    assert [r["spec"]["name"] for r in data["results"]] == [
        "dla/none+f64/d64/T32/s0", "dla/grm+f64/d64/T32/s0"]
    for r in data["results"]:
        assert "error" not in r, r.get("traceback")
        assert r["spec"]["dtype"] == "float64"
    assert all("dtype" not in s for s in mqar.make_specs(mqar.parse_args(argv)))
    # the equal-budget grm run that loglinear adds is labelled too
    ll = mqar.make_specs(mqar.parse_args(["--families", "linear", "--variants", "grm", "loglinear",
                                          "--variant-steps", "loglinear=3", "--dtype", "float64"]))
    names = [s["name"] for s in ll if s["family"] == "linear"]
    assert len(names) == 3 and len(set(names)) == 3
    assert all("+f64/" in n for n in names)
    with pytest.raises(SystemExit):
        mqar.parse_args(argv + ["--dtype", "float16"])
