"""Resume points: a request whose prompt starts with tokens the engine has computed before
resumes from the recurrent state there and computes only the rest, on every model family and
MC setting, with the same greedy tokens and logprobs as a fresh engine (DESIGN invariant 3)."""

from __future__ import annotations

import logging

import pytest
import torch
from test_rwkv7 import blinkdl_state_dict
from test_varlen_prefill import MODELS, V

from mcserve.config import EngineConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.prefix_keys import ResumeHasher, resume_key
from mcserve.engine.sampling import SamplingParams
from mcserve.models.fla_delta import FlaDeltaConfig, FlaDeltaForCausalLM
from mcserve.models.fla_gla import FlaGLAConfig, FlaGLAForCausalLM
from mcserve.models.registry import load_model

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def _fla_gla(variant: str = "none"):
    torch.manual_seed(3)
    cfg = FlaGLAConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2,
                       key_dim=16, value_dim=16, intermediate_size=32, use_short_conv=True,
                       conv_size=3, mc_variant=variant, segment_len=4, mc_top_k=1)
    return FlaGLAForCausalLM(cfg).double().eval()


def _fla_delta(model_type: str, variant: str = "none"):
    torch.manual_seed(4)
    cfg = FlaDeltaConfig(model_type=model_type, vocab_size=V, d_model=16, n_layers=2,
                         n_heads=2, qk_heads=2, key_dim=8, head_dim=8, intermediate_size=32,
                         mc_variant=variant, segment_len=4, mc_top_k=1)
    return FlaDeltaForCausalLM(cfg).double().eval()


_RWKV: dict[str, object] = {}


def _rwkv7(variant: str, tmp_path_factory):
    if variant not in _RWKV:
        path = tmp_path_factory.mktemp("rwkv7") / "tiny.pth"
        torch.save(blinkdl_state_dict(n_layer=2, C=64, N=32, vocab=V, ffn=64), path)
        _RWKV[variant] = load_model(path, dtype="float64", mc_overrides={
            "mc_variant": variant, "segment_len": 4, "mc_top_k": 1})
    return _RWKV[variant]


FAMILIES = {
    **MODELS,
    "gla-none": lambda _: _fla_gla("none"),
    "gla-post": lambda _: _fla_gla("post"),
    "deltanet-none": lambda _: _fla_delta("delta_net"),
    "gated-deltanet-none": lambda _: _fla_delta("gated_deltanet"),
    "gated-deltanet-grm": lambda _: _fla_delta("gated_deltanet", "grm"),
    "rwkv7-none": lambda f: _rwkv7("none", f),
    "rwkv7-grm": lambda f: _rwkv7("grm", f),
}


def _model(name: str, tmp_path_factory):
    make = FAMILIES[name]
    return make(tmp_path_factory) if name not in MODELS else make()


def engine(model, **kw) -> LLMEngine:
    args = dict(max_num_seqs=4, num_state_blocks=64, dtype="float64", max_model_len=96,
                checkpoint_interval=0)
    return LLMEngine(EngineConfig(**{**args, **kw}), model=model)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams = PARAMS, **kw):
    outs = LLM(engine=eng).generate([{"prompt_token_ids": p, **kw} for p in prompts], params,
                                    use_tqdm=False)
    return outs


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) <= 1e-9


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_next_turn_resumes_where_the_last_one_ended(name, tmp_path_factory):
    """Turn 2 = turn 1's prompt + its answer + new tokens: it resumes at turn 1's end (the
    last generated token was never computed) and equals a fresh engine, alone and batched."""
    model = _model(name, tmp_path_factory)
    eng = engine(model)
    p1 = rand_ids(13, 1)
    out1 = run(eng, [p1])[0]
    p2 = p1 + list(out1.outputs[0].token_ids) + rand_ids(7, 2)
    got = run(eng, [p2])[0]
    assert got.num_cached_tokens == len(p1) + PARAMS.max_tokens - 1
    assert eng.stats()["resume_points_hit"] == 1
    same([got], run(engine(model, enable_prefix_caching=False), [p2]))
    # batched with a fresh prompt and the same conversation once more
    p3 = rand_ids(9, 3)
    got = run(eng, [p2, p3, p2 + rand_ids(3, 4)])
    same(got, run(engine(model, enable_prefix_caching=False), [p2, p3, p2 + rand_ids(3, 4)]))
    end = len(p1) + PARAMS.max_tokens - 1  # or deeper: segment blocks of MC models
    assert got[0].num_cached_tokens >= end and got[2].num_cached_tokens >= end
    assert eng.cache.is_whole()


@pytest.mark.parametrize("name", ["linear-none", "linear-grm", "linear-ssc", "mamba2-none",
                                  "linear-loglinear", "dla-grm", "rwkv7-none", "gla-none"])
def test_requested_positions_and_grid(name, tmp_path_factory):
    """A position asked for (a system prompt's end) and the grid every checkpoint_interval
    tokens are resume points for any prompt that shares the tokens before them."""
    model = _model(name, tmp_path_factory)
    system = rand_ids(11, 5)
    eng = engine(model)
    run(eng, [system + rand_ids(6, 6)], resume_positions=[len(system)])
    prompts = [system + rand_ids(5, 7), system + rand_ids(8, 8)]
    got = run(eng, prompts)
    assert [g.num_cached_tokens for g in got] == [len(system)] * 2
    fresh = engine(model, enable_prefix_caching=False)
    same(got, run(fresh, prompts))
    grid = engine(model, checkpoint_interval=5)
    run(grid, [system + rand_ids(4, 9)])
    got = run(grid, prompts)
    assert [g.num_cached_tokens for g in got] == [10, 10]
    same(got, run(fresh, prompts))
    assert eng.cache.is_whole() and grid.cache.is_whole()


def test_default_grid_only_where_no_segment_blocks_resume():
    """Left unset, the grid is the store's default for a model without segment blocks; an MC
    model's segment blocks already hold the whole state at every segment end, so it keeps no
    grid (its prompt prefills in budget-sized chunks) and still resumes at the last block."""
    none = LLMEngine(EngineConfig(max_num_seqs=2, num_state_blocks=64, dtype="float64",
                                  max_model_len=96), model=MODELS["linear-none"]())
    assert none.checkpoint_interval == none.resume.default_interval(96) > 0
    model = MODELS["linear-ssc"]()
    eng = LLMEngine(EngineConfig(max_num_seqs=2, num_state_blocks=64, dtype="float64",
                                 max_model_len=96, max_num_batched_tokens=64), model=model)
    assert eng.checkpoint_interval == 0
    seen = []
    step = eng.runner.prefill
    eng.runner.prefill = lambda item, *a: seen.append(item.num_tokens) or step(item, *a)
    prompt = rand_ids(50, 30)
    run(eng, [prompt])
    assert seen == [50]  # one chunk: no grid mark cut it
    prompts = [prompt[:45] + rand_ids(7, 31)]
    got = run(eng, prompts)
    C = model.config.mc.segment_len
    assert got[0].num_cached_tokens == 45 // C * C
    same(got, run(engine(model, enable_prefix_caching=False), prompts))


def test_shared_system_prompt_is_computed_once():
    """16 users whose requests arrive together with one new system prompt: the first computes
    it, the others wait for its resume point and compute only their own tokens."""
    model = MODELS["mamba2-none"]()
    eng = engine(model, max_num_seqs=16, max_num_batched_tokens=64)
    system = rand_ids(30, 10)
    tails = [rand_ids(3, 100 + i) for i in range(16)]
    outs = run(eng, [system + t for t in tails], resume_positions=[len(system)])
    st = eng.stats()
    assert st["prompt_tokens_computed"] == len(system) + 16 * 3
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [len(system)] * 15
    same(outs, run(engine(model, enable_prefix_caching=False), [system + t for t in tails]))


def test_budget_evicts_least_recently_used_and_nothing_leaks():
    model = MODELS["linear-none"]()
    eng = engine(model)
    row = eng.resume.row_bytes
    eng.resume.budget_bytes = 3 * row  # room for three points
    convs = [rand_ids(9, 20 + i) for i in range(5)]
    ends = []
    for c in convs:
        out = run(eng, [c])[0]
        ends.append(c + list(out.outputs[0].token_ids[:-1]))
    st = eng.stats()
    assert st["resume_points"] == 3 and st["resume_points_evicted"] == 2
    assert st["resume_bytes_device"] <= 3 * row
    kept = [eng.resume.has(resume_key(e, len(e), eng.cache.salt)) for e in ends]
    assert kept == [False, False, True, True, True]  # the two oldest went
    assert eng.cache.is_whole()


def test_eviction_order_is_lru():
    model = MODELS["linear-none"]()
    eng = engine(model)
    eng.resume.budget_bytes = 2 * eng.resume.row_bytes
    a, b, c = rand_ids(9, 30), rand_ids(9, 31), rand_ids(9, 32)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run(eng, [a], sp)
    run(eng, [b], sp)
    assert run(eng, [a + [1]], sp)[0].num_cached_tokens == len(a)  # a is now the most recent
    run(eng, [c], sp)  # evicts b; a's own end point was added too, so a's first point goes
    assert run(eng, [b + [1]], sp)[0].num_cached_tokens == 0
    assert run(eng, [c + [1]], sp)[0].num_cached_tokens == len(c)


def test_prompt_logprobs_and_off_switch():
    model = MODELS["linear-grm"]()
    eng = engine(model)
    p = rand_ids(10, 40)
    run(eng, [p])
    sp = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    assert run(eng, [p + [3]], sp)[0].num_cached_tokens == 0  # every position is computed
    off = engine(model, enable_prefix_caching=False)
    run(off, [p])
    assert off.resume is None and run(off, [p + [3]])[0].num_cached_tokens == 0


def test_bad_resume_positions():
    eng = engine(MODELS["linear-none"]())
    for bad in ([0], [99], ["x"], [True]):
        with pytest.raises(ValueError, match="resume_positions") as e:
            eng.add_request("r", None, PARAMS, prompt_token_ids=[1, 2, 3],
                            resume_positions=bad)
        assert e.value.param == "resume_positions"
    assert eng.cache.is_whole() and not eng.requests


def test_preemption_and_swap_with_resume_points():
    model = MODELS["linear-grm"]()
    prompts = [rand_ids(17, 60 + i) for i in range(4)]
    want = run(engine(model, enable_prefix_caching=False), prompts)
    for kw in (dict(num_state_blocks=6, max_num_batched_tokens=8, checkpoint_interval=4),
               dict(num_state_blocks=6, host_state_blocks=16, max_num_batched_tokens=8)):
        eng = engine(model, **kw)
        same(run(eng, prompts), want)
        assert eng.stats()["num_preemptions"] > 0, kw
        same(run(eng, prompts), want)
        assert eng.cache.is_whole()


def test_resume_keys():
    ids = rand_ids(40, 70)
    h = ResumeHasher(b"salt")
    keys = h.keys(ids, [3, 40, 17])
    assert keys == {p: resume_key(ids, p, b"salt") for p in (3, 17, 40)}
    assert h.key(ids, 5) == resume_key(ids, 5, b"salt")  # backwards: restarts
    assert resume_key(ids, 5, b"other") != keys[3] and resume_key(ids, 5, b"salt") != keys[3]
    assert resume_key(ids[:5] + [0], 5, b"salt") == resume_key(ids, 5, b"salt")


# ------------------------------------------------------------------ disk tier
@pytest.mark.parametrize("name", ["mamba2-none", "mamba2-grm", "linear-ssc"])
def test_disk_tier_survives_a_restart(tmp_path, name):
    """A model served as trained (its whole state is the resume point) and MC models (the
    file carries the segment blocks before the point, imported into the pool on a hit)."""
    model = MODELS[name]()
    d = tmp_path / "cache"
    p1 = rand_ids(13, 80)
    eng = engine(model, state_cache_dir=str(d))
    out1 = run(eng, [p1])[0]
    eng.close()  # writes the points held in memory
    files = sorted(d.glob("*.safetensors"))
    assert files
    p2 = p1 + list(out1.outputs[0].token_ids) + rand_ids(5, 81)
    eng2 = engine(model, state_cache_dir=str(d))
    assert eng2.stats()["resume_points_disk"] == len(files)
    got = run(eng2, [p2])
    assert got[0].num_cached_tokens == len(p1) + PARAMS.max_tokens - 1
    assert eng2.stats()["resume_points_loaded_disk"] == 1
    same(got, run(engine(model, enable_prefix_caching=False), [p2]))
    assert eng2.cache.is_whole()


def test_eviction_spills_to_disk_within_its_bound(tmp_path):
    model = MODELS["linear-none"]()
    eng = engine(model, state_cache_dir=str(tmp_path))
    eng.resume.budget_bytes = eng.resume.row_bytes  # one point in memory
    convs = [rand_ids(9, 90 + i) for i in range(3)]
    ends = [c + list(run(eng, [c])[0].outputs[0].token_ids) for c in convs]
    st = eng.stats()
    assert st["resume_points"] == 1 and st["resume_points_spilled_disk"] == 2
    got = run(eng, [ends[0] + [1]])
    assert got[0].num_cached_tokens == len(ends[0]) - 1
    same(got, run(engine(model, enable_prefix_caching=False), [ends[0] + [1]]))
    assert eng.stats()["resume_points_loaded_disk"] == 1
    # the disk bound: a tier of one file's size keeps only the newest file
    size = max(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    small = engine(model, state_cache_dir=str(tmp_path / "small"))
    small.resume.budget_bytes = small.resume.row_bytes
    small.resume.disk_budget = size
    for c in convs:
        run(small, [c])
    assert len(list((tmp_path / "small").glob("*.safetensors"))) == 1


def test_bad_files_are_skipped_with_a_warning(tmp_path, caplog):
    model = MODELS["linear-none"]()
    p1 = rand_ids(13, 110)
    eng = engine(model, state_cache_dir=str(tmp_path))
    out1 = run(eng, [p1])[0]
    eng.close()
    (good,) = tmp_path.glob("*.safetensors")
    data = good.read_bytes()
    p2 = p1 + list(out1.outputs[0].token_ids) + [5]
    want = run(engine(model, enable_prefix_caching=False), [p2])

    def restart_and_ask():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mcserve.engine.resume"):
            e = engine(model, state_cache_dir=str(tmp_path))
            got = run(e, [p2])
        same(got, want)
        assert e.cache.is_whole()
        return got[0], caplog.text

    # a truncated file: unreadable, skipped at start-up
    good.write_bytes(data[:len(data) // 2])
    got, text = restart_and_ask()
    assert got.num_cached_tokens == 0 and "skipped" in text
    # flipped tensor bytes: the header is fine, the checksum is not (found on the hit)
    good.write_bytes(data[:-64] + bytes(b ^ 0x55 for b in data[-64:]))
    got, text = restart_and_ask()
    assert got.num_cached_tokens == 0 and "checksum" in text
    assert not good.exists()  # a bad file is removed once found bad
    # another model's file, and junk
    other = engine(MODELS["linear-grm"](), state_cache_dir=str(tmp_path))
    run(other, [p1])
    other.close()
    (tmp_path / "junk.safetensors").write_bytes(b"not a file at all")
    got, text = restart_and_ask()
    assert got.num_cached_tokens == 0
    assert "another model or MC configuration" in text and "unreadable" in text
    assert text.count("WARNING") == 1  # one line for the start-up scan


@pytest.mark.parametrize("name", ["mamba2-none", "linear-grm", "linear-ssc"])
def test_export_import_carries_the_resume_point(name):
    """``export_prefix(token_ids)`` takes the deepest resume point past the exported blocks
    along; another engine that imports it resumes there, equal to a fresh engine."""
    model = MODELS[name]()
    a, b = engine(model), engine(model)
    p1 = rand_ids(14, 120)
    out = run(a, [p1])[0]
    p2 = p1 + list(out.outputs[0].token_ids) + rand_ids(4, 121)
    export = a.export_prefix(p2)
    assert export.resume is not None and export.resume["pos"] == len(p1) + 5
    assert a.stats()["resume_points_hit"] == 0  # a peek, not a request's hit
    b.import_prefix(export)
    got = run(b, [p2])
    assert got[0].num_cached_tokens == len(p1) + 5
    same(got, run(engine(model, enable_prefix_caching=False), [p2]))
    other = engine(MODELS["linear-none" if name != "linear-none" else "linear-grm"]())
    with pytest.raises(ValueError):
        other.import_prefix(export)
    assert a.cache.is_whole() and b.cache.is_whole() and other.cache.is_whole()


def test_a_miss_says_why_at_debug_level(caplog):
    eng = engine(MODELS["linear-none"]())
    eng.resume.budget_bytes = eng.resume.row_bytes
    p1, p2 = rand_ids(9, 130), rand_ids(9, 131)
    e1 = p1 + list(run(eng, [p1])[0].outputs[0].token_ids)
    run(eng, [p2])  # evicts p1's point
    with caplog.at_level(logging.DEBUG, logger="mcserve.engine.scheduler"):
        run(eng, [e1 + [1]])
        run(eng, [rand_ids(5, 132)])
    assert "(evicted)" in caplog.text and "(no match)" in caplog.text


def test_tiers_spill_device_host_disk_in_lru_order(tmp_path):
    """The store alone: device points spill to the host tier, host points to the disk tier,
    least recently used first, pinned points stay; a disk point comes back on a hit."""
    from mcserve.engine.resume import ResumeStore

    layout = [{"mem.S": ((2, 3), torch.float32)}]
    row = 2 * 3 * 4
    st = ResumeStore(b"s", layout, device=torch.device("cpu"), budget_bytes=2 * row,
                     host_bytes=row, disk_dir=tmp_path, disk_bytes=10 * row)
    ids = [list(range(i, i + 5)) for i in range(5)]

    def put(i):
        st.put_rows(resume_key(ids[i], 5, b"s"), 5, 0, [{"mem.S": torch.full((2, 3), i + .5)}])

    put(0)
    put(1)
    rp, _ = st.lookup(ids[0], b"s", 1, 5)  # pinned: it may not move
    put(2)
    assert [p.tier for p in st.points.values()] == ["host", "device", "device"]  # 1 spilled
    put(3)  # device over: 0 is pinned, so 2 goes to the host, which pushes 1 to disk
    st.unpin(rp)
    tiers = {float(p.rows[0]["mem.S"][0, 0]) if p.rows else None: p.tier
             for p in st.points.values()}
    assert st.used["device"] <= 2 * row and st.used["host"] <= row
    assert st.num_spilled_host >= 2 and st.num_spilled_disk >= 1 and len(st.disk) >= 1
    assert "host" in tiers.values()
    got, _ = st.lookup(ids[1], b"s", 1, 5)  # from disk, checked, back in the device tier
    assert got is not None and got.tier == "device"
    assert torch.equal(got.rows[0]["mem.S"], torch.full((2, 3), 1.5))
    assert st.num_loaded_disk == 1
    st.unpin(got)


def test_the_grid_thins_out_along_a_long_prompt():
    """Resume points every interval up to four intervals, then at spacings that double: a
    long prompt ends few prefill chunks at marks (24 for 32K tokens at interval 256), and every
    prefix still has a point at least three quarters of the way in."""
    from mcserve.engine.scheduler import grid_step

    def marks(interval: int, n: int) -> list[int]:
        out, p = [], 0
        while True:
            step = grid_step(interval, p)
            p = (p // step + 1) * step
            if p > n:
                return out
            out.append(p)

    m = marks(256, 32768)
    assert m[:8] == [256 * i for i in range(1, 9)] and m[-1] == 32768 and len(m) == 24
    for n in range(256, 32769, 97):
        assert max(q for q in m if q <= n) >= 0.75 * n - 256, n
    # in the engine: the points of a long prompt are the grid's marks
    model = MODELS["mamba2-none"]()
    eng = engine(model, checkpoint_interval=4, max_model_len=512, max_num_batched_tokens=256)
    prompt = rand_ids(150, 21)
    run(eng, [prompt])
    want = marks(4, len(prompt) - 1)
    assert want[:4] == [4, 8, 12, 16] and len(want) < 20
    assert set(want) <= set(eng.resume.positions)
    # a prompt sharing 120 of its tokens resumes at the deepest mark before them
    other = prompt[:120] + rand_ids(7, 22)
    got = run(eng, [other])
    assert got[0].num_cached_tokens == max(q for q in want if q <= 120)
    same(got, run(engine(model, enable_prefix_caching=False, max_model_len=512), [other]))
