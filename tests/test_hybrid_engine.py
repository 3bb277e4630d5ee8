"""Hybrid models in the engine (every family of tests/hybrid_models): the attention layers on the
paged KV cache beside the recurrent state cache. Greedy tokens and logprobs against transformers'
full forward (teacher-forced), chunked prefill, batch invariance, resume points (the recurrent
state and the KV of one token restored together) checked against a fresh engine, preemption,
abort, and pools whole afterwards."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import FAMILIES, MC_FAMILIES

from mcserve.config import EngineConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams

N_NEW = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = FAMILIES[request.param].save_tiny(path)
    return str(path), ref


def _engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_mib=4,
                state_cache_mib=64, kv_block_size=16)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _prompts(V: int, lens=(5, 40, 77, 13), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def _run(eng: LLMEngine, prompts, tag: str = "r", **kw):
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", None, params, prompt_token_ids=p, **kw)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


def _assert_whole(eng: LLMEngine) -> None:
    assert eng.cache.is_whole()
    held = eng.resume.kv_held if eng.resume is not None else 0
    assert eng.kv.is_whole(held), (eng.kv.num_free, held, eng.kv.num_blocks)


@torch.no_grad()
def _check_against_reference(ref, prompt: list[int], out) -> None:
    toks = out.outputs[0].token_ids
    lp = ref(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert toks == lp.argmax(-1).tolist()
    got = torch.tensor([out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)])
    torch.testing.assert_close(got, lp[torch.arange(len(toks)), toks], atol=1e-4, rtol=0)


def test_batched_chunked_decode_matches_transformers(family):
    path, ref = family
    prompts = _prompts(ref.config.vocab_size)
    eng = _engine(path)
    assert "kv_cache=" in eng.describe()
    for p, out in zip(prompts, _run(eng, prompts), strict=True):
        _check_against_reference(ref, p, out)
    _assert_whole(eng)


def test_each_alone_equals_batched(family):
    path, ref = family
    prompts = _prompts(ref.config.vocab_size, (9, 31, 3), seed=1)
    together = [o.outputs[0].token_ids for o in _run(_engine(path), prompts)]
    eng = _engine(path, max_num_batched_tokens=2048, enable_prefix_caching=False)
    alone = [_run(eng, [p], tag=f"a{i}")[0].outputs[0].token_ids for i, p in enumerate(prompts)]
    assert together == alone


def test_next_turn_resumes_with_kv_and_state_of_one_token(family):
    path, ref = family
    V = ref.config.vocab_size
    eng = _engine(path)
    fresh = _engine(path, enable_prefix_caching=False)
    sys_prompt = _prompts(V, (37,), seed=2)[0]
    turn1 = sys_prompt + [1, 2, 3]
    out1 = _run(eng, [turn1], tag="t1")[0]
    # the next turn sends the conversation back with a new message: the engine resumes at the
    # end of the first request (prompt + generated but the last token), a point inside a KV
    # block (partial block copied), and computes only the rest
    turn2 = turn1 + out1.outputs[0].token_ids + [4, 5, 6, 7]
    out2 = _run(eng, [turn2], tag="t2")[0]
    assert out2.num_cached_tokens == len(turn1) + N_NEW - 1
    assert (len(turn1) + N_NEW - 1) % eng.kv.block_size  # inside a block
    want = _run(fresh, [turn2], tag="f")[0]
    assert out2.outputs[0].token_ids == want.outputs[0].token_ids
    _check_against_reference(ref, turn2, out2)
    # a message end asked for: two users with one system prompt resume there
    users = [sys_prompt + [7, 8], sys_prompt + [9]]
    _run(eng, [users[0]], tag="u0", resume_positions=[len(sys_prompt)])
    got = _run(eng, [users[1]], tag="u1")[0]
    assert got.num_cached_tokens == len(sys_prompt)
    assert got.outputs[0].token_ids == _run(fresh, [users[1]], tag="fu")[0].outputs[0].token_ids
    _assert_whole(eng)
    _assert_whole(fresh)


def test_preemption_under_a_small_kv_pool_gives_the_same_tokens(family):
    path, ref = family
    prompts = _prompts(ref.config.vocab_size, (60, 45, 70, 50), seed=3)
    want = [o.outputs[0].token_ids for o in _run(_engine(path), prompts)]
    eng = _engine(path, num_kv_blocks=14)  # room for about two of the four at once
    got = _run(eng, prompts)
    assert [o.outputs[0].token_ids for o in got] == want
    assert eng.scheduler.num_preemptions > 0
    _assert_whole(eng)


def test_a_preempted_hybrid_resumes_from_the_point_it_leaves(family, tmp_path):
    """Preempted, a hybrid keeps its state as a resume point; its KV goes to the disk tier
    when the pool wants the blocks, and the readmitted sequence resumes there instead of
    recomputing: the same tokens as without preemption."""
    path, ref = family
    prompts = _prompts(ref.config.vocab_size, (60, 45, 70, 50), seed=3)
    want = [o.outputs[0].token_ids for o in _run(_engine(path), prompts)]
    eng = _engine(path, num_kv_blocks=14, checkpoint_interval=0,
                  state_cache_dir=str(tmp_path / "points"))
    got = _run(eng, prompts)
    assert [o.outputs[0].token_ids for o in got] == want
    st = eng.stats()
    assert eng.scheduler.num_preemptions > 0
    assert st["resume_points_hit"] > 0 and st["resume_points_spilled_disk"] > 0
    _assert_whole(eng)


def test_abort_returns_the_kv_blocks(family):
    path, ref = family
    eng = _engine(path, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    eng.add_request("x", None, params, prompt_token_ids=_prompts(ref.config.vocab_size, (70,))[0])
    for _ in range(4):
        eng.step()
    assert eng.kv.num_free < eng.kv.num_blocks
    eng.abort_request("x")
    eng.step()
    _assert_whole(eng)



@pytest.mark.parametrize("fam", MC_FAMILIES)
@torch.no_grad()
def test_post_hoc_mc_on_the_recurrent_layers(fam, tmp_path):
    """grm over 16-token segments on the recurrent layers (segment blocks in the pool) with the
    attention layers on the KV pool: the engine's greedy tokens are the model's own (full
    forward under the same MC), and a resumed next turn equals a fresh engine's."""
    from mcserve.models.registry import load_model

    ref = FAMILIES[fam].save_tiny(tmp_path)
    mc = dict(mc_variant="grm", segment_len=16)
    model = load_model(tmp_path, mc_overrides=mc)
    eng = _engine(str(tmp_path), **mc)
    assert eng.num_state_blocks > 0
    prompts = _prompts(ref.config.vocab_size, (21, 50), seed=4)
    outs = _run(eng, prompts)
    for p, out in zip(prompts, outs, strict=True):
        toks = out.outputs[0].token_ids
        logits, _ = model(torch.tensor([p + toks]))
        assert toks == logits[0, len(p) - 1:-1].argmax(-1).tolist()
    turn2 = prompts[1] + outs[1].outputs[0].token_ids + [3, 1, 4]
    got = _run(eng, [turn2], tag="t")[0]
    assert got.num_cached_tokens > 0
    fresh = _engine(str(tmp_path), enable_prefix_caching=False, **mc)
    assert got.outputs[0].token_ids == _run(fresh, [turn2], tag="f")[0].outputs[0].token_ids
    _assert_whole(eng)


def test_resume_points_survive_a_restart_and_move_between_engines(family, tmp_path):
    """A hybrid's resume point leaves the KV pool with its KV copied out: written to the disk
    tier at shutdown and found by a restarted engine, or exported to another engine; either
    resumes the next turn as a fresh engine computes it. A file whose KV has the wrong shape is
    skipped, not loaded."""
    from safetensors.torch import load_file, save_file

    path, ref = family
    V = ref.config.vocab_size
    turn1 = _prompts(V, (29,), seed=5)[0]
    eng = _engine(path, state_cache_dir=str(tmp_path / "points"))
    out1 = _run(eng, [turn1], tag="a")[0]
    turn2 = turn1 + out1.outputs[0].token_ids + [2, 7, 1]
    pos = len(turn1) + N_NEW - 1
    want = _run(_engine(path, enable_prefix_caching=False), [turn2], tag="f")[0]
    export = eng.export_prefix(turn2)
    assert export.resume is not None and export.resume["kv"][0].shape[1] == pos
    eng.close()
    _assert_whole(eng)
    files = sorted((tmp_path / "points").glob("*"))
    assert files
    kept = {f.name: (load_file(str(f)), _meta(f)) for f in files}  # loading a point takes it

    again = _engine(path, state_cache_dir=str(tmp_path / "points"))
    got = _run(again, [turn2], tag="b")[0]
    assert got.num_cached_tokens == pos
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_whole(again)

    other = _engine(path)
    other.import_prefix(export)
    got = _run(other, [turn2], tag="c")[0]
    assert got.num_cached_tokens == pos
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_whole(other)

    # a point file whose KV is cut short is skipped with a warning, and the turn recomputed
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    for name, (tensors, meta) in kept.items():
        tensors["kv.k"] = tensors["kv.k"][:, :-1].contiguous()
        save_file(tensors, str(bad_dir / name), metadata=meta)
    broken = _engine(path, state_cache_dir=str(bad_dir))
    got = _run(broken, [turn2], tag="d")[0]
    assert got.num_cached_tokens == 0
    assert broken.resume.num_bad_files >= 1
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def _meta(f) -> dict:
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as fh:
        return fh.metadata()


def test_static_decode_step_matches_the_ragged_one(family):
    """The static decode step (what CUDA graphs capture; run eagerly here): the batch padded to
    a bucket with rows on the scratch slot and the KV pool's scratch block, the KV table padded
    to a width bucket. Same tokens and logprobs as the ragged step."""
    path, ref = family
    prompts = _prompts(ref.config.vocab_size, (11, 37, 3), seed=6)
    want = _run(_engine(path), prompts)
    eng = _engine(path)
    eng.runner.static_decode = True
    calls = []
    step = eng.runner.static_forward
    eng.runner.static_forward = lambda B, N, **kw: calls.append((B, N)) or step(B, N, **kw)
    got = _run(eng, prompts)
    assert calls and all(B in eng.runner.batch_buckets and N in eng.runner.width_buckets
                         for B, N in calls)
    assert any(B > 1 and B != len(prompts) for B, _ in calls)  # padded rows were in the step
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), atol=1e-5, rtol=0)
    _assert_whole(eng)


def test_static_step_on_padding_touches_only_the_scratch_rows(family):
    """What CUDA-graph warm-up and capture run: the static step on the padding that
    ``reset_static_inputs`` writes, at every (batch, width) bucket. It reads and writes only the
    scratch slot and the KV pool's scratch block: every bucket reads the same padding, so none
    writes into a real block or reads a table entry past the pool."""
    path, _ = family
    eng = _engine(path)
    r, kv = eng.runner, eng.kv
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    kv.k[:, kv.scratch] = 0.0
    kv.v[:, kv.scratch] = 0.0
    r.reset_static_inputs()
    for B in r.batch_buckets:
        for N in r.width_buckets:
            logits = r.static_forward(B, N)
            assert logits.shape[0] == B and torch.isfinite(logits).all(), (B, N)
    others = [b for b in range(kv.k.shape[1]) if b != kv.scratch]
    assert kv.k[:, others].isnan().all() and kv.v[:, others].isnan().all()
    _assert_whole(eng)
