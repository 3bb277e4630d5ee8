"""Hybrid models on an NVIDIA GPU: every family of tests/hybrid_models served on CUDA (the Triton
paged decode attention, the varlen prefill over the paged KV pool, the MoE layers) gives the
CPU engine's greedy tokens and logprobs, eagerly and with the decode step captured as CUDA
graphs (the KV table in the static step), and a resumed next turn equals a fresh CUDA engine.

Run as ``MCSERVE_TEST_CUDA=1 pytest tests/test_cuda_hybrid.py``. The tiny checkpoints are saved
by transformers; a GPU image whose transformers lacks a family can be pointed at checkpoints
saved elsewhere with ``MCSERVE_HYBRID_FIXTURES=DIR`` (``DIR/<model_type>/``, as
``cd tests && python -m hybrid_models DIR`` writes them). Without a GPU every test here
skips, naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hybrid_models import FAMILIES

from mcserve.config import EngineConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.kernels import dispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU (CUDA): none is visible to torch")

N_NEW = 12
# a token whose logprob is within this of the reference's choice counts as a tie (float32 on
# two devices sums in different orders)
TIE = 2e-3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request, tmp_path_factory) -> str:
    fixtures = os.environ.get("MCSERVE_HYBRID_FIXTURES")
    if fixtures and (Path(fixtures) / request.param / "config.json").exists():
        return str(Path(fixtures) / request.param)
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param].save_tiny(path)
    return str(path)


@pytest.fixture(autouse=True)
def _no_tf32():
    prev = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = prev


def _engine(path: str, device: str, **kw) -> LLMEngine:
    args = dict(model=path, device=device, max_num_seqs=4, max_num_batched_tokens=48,
                kv_cache_mib=4, state_cache_mib=64, kv_block_size=16)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def _prompts(V: int, lens=(5, 40, 77, 13), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]


def _run(eng: LLMEngine, prompts, tag: str = "r", **kw) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True, logprobs=1)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}{i}", None, params, prompt_token_ids=p, **kw)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    res = []
    for i in range(len(prompts)):
        c = outs[f"{tag}{i}"].outputs[0]
        res.append((c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids,
                                                               strict=True)]))
    return res


def _assert_same(got, want) -> None:
    """Same greedy tokens and logprobs; a divergence is accepted only at a near tie (both
    choices within TIE of each other), and the comparison stops there."""
    for (gt, gl), (wt, wl) in zip(got, want, strict=True):
        for i, (a, b) in enumerate(zip(gt, wt, strict=True)):
            assert abs(gl[i] - wl[i]) < TIE, (i, gt, wt, gl, wl)
            if a != b:
                break


def _assert_whole(eng: LLMEngine) -> None:
    assert eng.cache.is_whole()
    held = eng.resume.kv_held if eng.resume is not None else 0
    assert eng.kv.is_whole(held)


def test_hybrid_on_cuda_matches_cpu_eager_and_graphed(ckpt, monkeypatch):
    from mcserve.kernels import attention

    calls = []
    real = attention.paged_decode

    def spy(q, *a, **kw):
        calls.append(dispatch.get_backend(q))
        return real(q, *a, **kw)

    monkeypatch.setattr(attention, "paged_decode", spy)
    cpu = _engine(ckpt, "cpu")
    prompts = _prompts(cpu.model_config.vocab_size)
    want = _run(cpu, prompts)
    calls.clear()
    eager = _engine(ckpt, "cuda", enforce_eager=True)
    assert eager.runner.graphs is None
    got_eager = _run(eager, prompts)
    assert calls and set(calls) == {"triton"}, "the decode attention did not reach Triton"
    _assert_same(got_eager, want)
    _assert_whole(eager)
    graphed = _engine(ckpt, "cuda")
    assert graphed.runner.graphs is not None, "no CUDA graph was captured (see the log)"
    got = _run(graphed, prompts)
    assert graphed.runner.graphs.num_replays > 0
    _assert_same(got, want)
    _assert_whole(graphed)


def test_hybrid_next_turn_on_cuda_resumes_like_a_fresh_engine(ckpt):
    eng = _engine(ckpt, "cuda", max_num_batched_tokens=2048)
    V = eng.model_config.vocab_size
    turn1 = _prompts(V, (45,), seed=3)[0]
    (toks, _), = _run(eng, [turn1], tag="a")
    turn2 = turn1 + toks + _prompts(V, (9,), seed=4)[0]
    got = _run(eng, [turn2], tag="b")
    assert eng.stats()["prompt_tokens_cached"] > 0
    fresh = _engine(ckpt, "cuda", max_num_batched_tokens=2048, enable_prefix_caching=False)
    _assert_same(got, _run(fresh, [turn2], tag="c"))
    _assert_whole(eng)
