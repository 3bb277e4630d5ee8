"""The engine on an NVIDIA GPU: the Triton decode readout (reached through the
``MCMemory.decode_paged`` hook) gives the same greedy tokens as the CPU engine's torch path.

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

    def spy(mc, pl, q, *a, **kw):
        calls.append(dispatch.get_backend(q))
        return real(mc, pl, q, *a, **kw)

    monkeypatch.setattr(MCMemory, "decode_paged_kernels", spy)
    want, _ = _run(_model(memory, variant, mode, "cpu"), "cpu")
    assert not calls  # CPU tensors keep the torch path
    got, _ = _run(_model(memory, variant, mode, "cuda"), "cuda", **pool)
    assert calls and set(calls) == {"triton"}, "the engine did not reach the Triton kernels"
    assert got == want
