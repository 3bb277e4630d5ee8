"""The engine on an NVIDIA GPU: the Triton decode readout (reached through the
``MCMemory.decode_paged`` hook) gives the same greedy tokens as the CPU engine's torch path, and
so do the CUDA graphs of the static decode step (``engine/cuda_graphs.py``) against the eager
step (``enforce_eager``).

Run on a machine with a GPU as ``MCSERVE_TEST_CUDA=1 pytest tests/test_cuda.py
tests/test_triton_kernels.py`` (the variable keeps ``TRITON_INTERPRET`` unset so the kernels are
compiled; see tests/conftest.py). Without a GPU every test here skips, naming it.
"""

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.kernels import dispatch
from mcserve.models.native import MCForCausalLM

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs an NVIDIA GPU (CUDA): none is visible to torch")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_LENS = [1, 5, 9, 23, 40, 61]


def _model(memory: str, variant: str, mode: str, device: str) -> MCForCausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=8,
                      memory=memory, mc_variant=variant, mc_mode=mode, segment_len=4,
                      mc_top_k=2, inner_chunk=2)
    return MCForCausalLM(cfg).double().to(device)


def _run(model: MCForCausalLM, device: str, **kw) -> tuple[list[list[int]], LLMEngine]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]
    args = dict(max_num_seqs=8, num_state_blocks=256, max_num_batched_tokens=64,
                dtype="float64", max_model_len=128, device=device)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=model)
    outs = LLM(engine=eng).generate(prompts, GREEDY)
    assert eng.cache.is_whole()
    return [o.outputs[0].token_ids for o in outs], eng


def test_engine_on_cuda_none_matches_cpu():
    # no MC: the in-place decode step (LinearMemory.step_) on views of the CUDA slot pool
    want, _ = _run(_model("linear", "none", "checkpoint", "cpu"), "cpu")
    got, _ = _run(_model("linear", "none", "checkpoint", "cuda"), "cuda")
    assert got == want


@pytest.mark.parametrize("memory,variant,mode,pool", [
    pytest.param("linear", "grm", "checkpoint", {}, id="linear-grm"),
    pytest.param("swla", "soup", "checkpoint", {}, id="swla-soup"),
    pytest.param("linear", "ssc", "independent", {}, id="linear-ssc"),
    pytest.param("linear", "ssc", "checkpoint",
                 dict(num_state_blocks=24, host_state_blocks=256), id="linear-ssc-host-tier"),
])
def test_engine_on_cuda_matches_cpu(monkeypatch, memory, variant, mode, pool):
    from mcserve.models.mc import MCMemory

    calls = []
    real = MCMemory.decode_paged_kernels
    real_fused = dispatch.fused_linear_decode

    def spy(mc, pl, q, *a, **kw):
        calls.append(dispatch.get_backend(q))
        return real(mc, pl, q, *a, **kw)

    def spy_fused(x, *a, **kw):
        calls.append(dispatch.get_backend(x))
        return real_fused(x, *a, **kw)

    # the linear memory's decode is one fused call per layer; swla and host-tier blocks take
    # decode_paged_kernels
    monkeypatch.setattr(MCMemory, "decode_paged_kernels", spy)
    monkeypatch.setattr(dispatch, "fused_linear_decode", spy_fused)
    want, _ = _run(_model(memory, variant, mode, "cpu"), "cpu")
    assert not calls  # CPU tensors keep the torch path
    got, _ = _run(_model(memory, variant, mode, "cuda"), "cuda", **pool)
    assert calls and set(calls) == {"triton"}, "the engine did not reach the Triton kernels"
    assert got == want


# ------------------------------------------------------------------ CUDA graphs of decode
def _mamba2(variant: str, device: str):
    from mcserve.models.mamba2 import Mamba2Config, Mamba2MCForCausalLM

    torch.manual_seed(0)
    model = Mamba2MCForCausalLM(Mamba2Config(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, head_dim=8, state_size=8,
        mc_variant=variant, segment_len=4, mc_top_k=2))
    with torch.no_grad():
        for blk in model.layers:
            blk.mixer.A_log.uniform_(-1.0, 1.0)
    return model.double().eval().to(device)


GRAPH_MODELS = {
    "linear-grm": lambda dev: _model("linear", "grm", "checkpoint", dev),
    "linear-ssc-indep": lambda dev: _model("linear", "ssc", "independent", dev),
    "linear-post": lambda dev: _model("linear", "post", "checkpoint", dev),
    "swla-soup": lambda dev: _model("swla", "soup", "checkpoint", dev),
    "linear-none": lambda dev: _model("linear", "none", "checkpoint", dev),
    "mamba2-none": lambda dev: _mamba2("none", dev),
    "mamba2-grm": lambda dev: _mamba2("grm", dev),
}


def _run_n(model, device: str, n: int, **kw) -> tuple[list[list[int]], LLMEngine]:
    g = torch.Generator().manual_seed(2)
    lens = [1, 5, 9, 23, 40, 61, 7][:n]
    prompts = [torch.randint(0, 256, (m,), generator=g).tolist() for m in lens]
    args = dict(max_num_seqs=8, num_state_blocks=256, max_num_batched_tokens=64,
                dtype="float64", max_model_len=128, device=device)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=model)
    outs = LLM(engine=eng).generate(prompts, GREEDY, use_tqdm=False)
    assert eng.cache.is_whole()
    return [o.outputs[0].token_ids for o in outs], eng


@pytest.mark.parametrize("n", [3, 5, 7])
@pytest.mark.parametrize("name", list(GRAPH_MODELS))
def test_decode_graphs_match_eager(name, n):
    # graphs captured at start-up, replayed for every decode step; same tokens as the eager
    # ragged step on the GPU and as the CPU engine
    want, _ = _run_n(GRAPH_MODELS[name]("cpu"), "cpu", n)
    eager, e_eng = _run_n(GRAPH_MODELS[name]("cuda"), "cuda", n, enforce_eager=True)
    assert e_eng.runner.graphs is None and not e_eng.runner.static_decode
    got, eng = _run_n(GRAPH_MODELS[name]("cuda"), "cuda", n)
    assert eng.runner.graphs is not None, "no CUDA graph was captured (see the log)"
    assert eng.runner.graphs.num_replays > 0
    assert got == eager == want


def test_decode_graph_fallbacks():
    # per-request top_k and host-tier blocks run the static step eagerly; deep memories (the
    # inner-chunk fill is read on the host) are never captured
    model = _model("linear", "ssc", "checkpoint", "cuda")
    want, _ = _run_n(_model("linear", "ssc", "checkpoint", "cpu"), "cpu", 7,
                     num_state_blocks=24, host_state_blocks=256)
    got, eng = _run_n(model, "cuda", 7, num_state_blocks=24, host_state_blocks=256)
    assert eng.runner.graphs is not None and got == want
    assert eng.stats()["host_blocks_offloaded"] > 0
    _, eng = _run_n(_model("dla", "grm", "checkpoint", "cuda"), "cuda", 3)
    assert eng.runner.graphs is None and not eng.runner.static_decode
    want, _ = _run_n(_model("dla", "grm", "checkpoint", "cpu"), "cpu", 3)
    assert _run_n(_model("dla", "grm", "checkpoint", "cuda"), "cuda", 3)[0] == want


def test_decode_graph_replay_does_not_sync():
    _, eng = _run_n(_model("linear", "grm", "checkpoint", "cuda"), "cuda", 1)
    runner = eng.runner
    B, N = runner.batch_buckets[2], runner.width_buckets[-1]
    runner.reset_static_inputs()
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.graphs.replay(B, N)
        runner.static_forward(B, N)  # the eager twin of the graph, on the same inputs
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    assert out.shape == (B, eng.model_config.vocab_size)
    assert eng.cache.is_whole()
