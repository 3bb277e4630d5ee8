"""Low-precision models keep only their compact weights (``models/compact_weight.py``): a
``CompactWeight`` reads as the exact float32 values its int8 / bfloat16 copy represents for any
torch op, is read-only, and the engine's precision step releases the float32 weights without
changing a single greedy token or logprob."""

from __future__ import annotations

import functools
import gc
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hybrid_models import FAMILIES
from lowp_helpers import generate
from torch import nn

from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR
from mcserve.kernels import cpu
from mcserve.models import lowp_linear as lp
from mcserve.models.checkpoint import load_checkpoint, save_checkpoint
from mcserve.models.compact_weight import CompactWeight, compact_parameter, materialized
from mcserve.models.moe import Experts
from mcserve.models.native import MCForCausalLM
from mcserve.models.registry import load_model

needs_ops = pytest.mark.skipif(cpu.ops() is None,
                               reason=f"C++ CPU kernels unavailable: {cpu.status()}")


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_compact_weight_reads_as_its_values(kind):
    """Every op sees the dequantized values; ``embedding`` and one expert of a stack read only
    their rows / expert; ``detach`` and ``nn.Parameter`` keep it compact."""
    g = torch.Generator().manual_seed(3)
    lw = lp.make_lowp(kind, torch.randn(45, 37, generator=g))  # rows not a multiple of 16
    w = compact_parameter((lw,))
    ref = lw.dequantized()
    assert isinstance(w, CompactWeight) and isinstance(w, nn.Parameter)
    assert (w.shape, w.dtype, w.requires_grad) == (torch.Size([45, 37]), torch.float32, False)
    assert isinstance(w.detach(), CompactWeight) and w.detach().data_ptr() == w.data_ptr()
    x = torch.randn(3, 5, 37, generator=g)
    torch.testing.assert_close(F.linear(x, w), F.linear(x, ref), rtol=0, atol=0)
    idx = torch.tensor([[0, 44, 16, 15], [31, 31, 7, 32]])
    with torch.inference_mode():
        torch.testing.assert_close(F.embedding(idx, w), ref[idx], rtol=0, atol=0)
    emb = nn.Embedding(45, 37)
    emb.weight = w
    torch.testing.assert_close(emb(idx[0]), ref[idx[0]], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([w, w.detach()]), torch.cat([ref, ref]), rtol=0, atol=0)
    out = torch.empty(3, 5, 45)
    torch.matmul(x, w.t(), out=out)  # an op that writes elsewhere reads it like any other
    torch.testing.assert_close(out, x @ ref.t(), rtol=0, atol=0)
    torch.testing.assert_close(materialized(w), ref, rtol=0, atol=0)
    assert materialized(ref) is ref

    parts = tuple(lp.make_lowp(kind, torch.randn(20, 33, generator=g)) for _ in range(3))
    stack = compact_parameter(parts, stacked=True)
    assert stack.shape == (3, 20, 33)
    for e in (0, 2, -1):
        assert type(stack[e]) is torch.Tensor
        torch.testing.assert_close(stack[e], parts[e].dequantized(), rtol=0, atol=0)
    torch.testing.assert_close(stack[1:], torch.stack([p.dequantized() for p in parts[1:]]))
    with pytest.raises(ValueError, match="same shape"):
        CompactWeight((parts[0], lw), stacked=True)


def test_compact_weight_is_read_only():
    w = compact_parameter((lp.make_lowp("int8", torch.randn(32, 16)),))
    before = materialized(w).clone()
    with torch.no_grad():
        for change in (lambda: w.mul_(2), lambda: w.copy_(torch.zeros(32, 16)),
                       lambda: w.zero_(), lambda: torch.add(w, 1, out=w)):
            with pytest.raises(RuntimeError, match="int8 form only.*float checkpoint"):
                change()
    torch.testing.assert_close(materialized(w), before, rtol=0, atol=0)


def _assert_same_tokens(a: nn.Module, b: nn.Module) -> None:
    """The engine's greedy tokens and logprobs of three random prompts are the same on both."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, a.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 23, 2)]
    kw = dict(max_tokens=6, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_mib=4,
              state_cache_mib=64)
    assert generate(a, prompts, **kw) == generate(b, prompts, **kw)


def _convert(model: nn.Module, kind: str, min_numel: int, release: bool) -> tuple[int, ...]:
    """The engine's precision step (``prepare_cpu_weights``) at another size threshold: how
    many linears, ``Experts`` and embeddings changed."""
    return (lp.apply_weight_precision(model, kind, min_numel=min_numel, release=release),
            lp.apply_expert_precision(model, kind, min_numel=min_numel, release=release),
            lp.apply_embedding_precision(model, kind, min_numel=min_numel, release=release))


def _released_pair(load, kind: str, min_numel: int):
    """The same model twice with ``kind`` weights: float32 kept (rounded) and released; and
    weak references to the released model's float32 parameters that were converted."""
    kept, released = load(), load()
    _convert(kept, kind, min_numel, release=False)
    converted = {id(m.weight) for m in kept.modules() if lp.lowp_of(m) is not None}
    converted |= {id(p) for m in kept.modules() if isinstance(m, Experts)
                  for p in (m.w_in, m.down_proj)}
    converted |= {id(m.weight) for m in kept.modules() if isinstance(m, nn.Embedding)
                  and m.__dict__.get("lowp") is not None}
    names = [n for n, p in kept.named_parameters(remove_duplicate=False) if id(p) in converted]
    params = dict(released.named_parameters(remove_duplicate=False))
    floats = [weakref.ref(params[n]) for n in names]
    del params
    _convert(released, kind, min_numel, release=True)
    return kept, released, floats


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("family", ["default", "granitemoehybrid", "qwen3_next"])
def test_release_changes_no_token_and_frees_the_float_weights(family, kind, tmp_path):
    """Released and kept models give the same greedy tokens and logprobs, through the kernels
    and through the twins (where every op reads the compact weights' values); the float32
    parameters are gone (a tied embedding reads its rows from the head's copy)."""
    if family == "default":
        def load():
            return load_model(DEFAULT_MODEL_DIR)
        min_numel = lp.MIN_NUMEL
    else:
        FAMILIES[family].save_tiny(tmp_path)

        def load():
            return load_model(tmp_path)
        min_numel = 1
    kept, released, floats = _released_pair(load, kind, min_numel)
    gc.collect()
    assert floats and all(r() is None for r in floats)  # their float32 storage is freed
    before = {n: p for n, p in released.named_parameters()}
    assert _convert(released, kind, min_numel, release=True) == (0, 0, 0)
    assert all(p is before[n] for n, p in released.named_parameters())  # idempotent
    info_kept, info = lp.weight_precision(kept), lp.weight_precision(released)
    assert info["float32_kept_bytes"] == 0 < info_kept["float32_kept_bytes"]
    assert info["linears"] == info_kept["linears"] and info["experts"] == info_kept["experts"]
    assert info["compact_bytes"] == info_kept["compact_bytes"]
    assert (info_kept["held_bytes"] - info["held_bytes"]
            == info["float32_bytes"] - info["compact_bytes"] > 0)
    if family == "default":
        assert isinstance(released.lm_head.weight, CompactWeight)
        assert released.embed.weight is released.lm_head.weight
    else:  # untied: the embedding has its own copy, read row by row
        assert info["embeddings"] == 1 and isinstance(released.embed.weight, CompactWeight)
        experts = [m for m in released.modules() if isinstance(m, Experts)]
        assert experts and all(isinstance(m.w_in, CompactWeight)
                               and isinstance(m.down_proj, CompactWeight) for m in experts)
        with torch.inference_mode():  # the expert loop reads the copies
            assert all(m.compact(torch.zeros(1, m.w_in.shape[-1])) is not None for m in experts)
    _assert_same_tokens(released, kept)
    with cpu.twins_only():
        _assert_same_tokens(released, kept)


@needs_ops
def test_engine_releases_only_where_the_kernels_run():
    """``prepare_cpu_weights`` (the engine's step) releases the float32 weights by default when
    the C++ kernels run, and keeps them (rounded) where they do not."""
    model = MCForCausalLM(load_model(DEFAULT_MODEL_DIR).config)
    assert lp.prepare_cpu_weights(model, "float32", "int8") > 0
    assert lp.weight_precision(model)["float32_kept_bytes"] == 0
    model = MCForCausalLM(model.config)
    with cpu.twins_only():
        assert lp.prepare_cpu_weights(model, "bfloat16", None) > 0
    info = lp.weight_precision(model)
    assert info["float32_kept_bytes"] == info["float32_bytes"] > 0


@needs_ops
def test_save_checkpoint_of_a_released_model(tmp_path):
    """A released model saves the float32 values its weights stand for, tied weights once."""
    model = load_model(DEFAULT_MODEL_DIR)
    lp.prepare_cpu_weights(model, "float32", "int8")
    assert isinstance(model.lm_head.weight, CompactWeight)
    save_checkpoint(model, tmp_path / "ck")
    back = load_checkpoint(tmp_path / "ck", MCForCausalLM)
    assert back.lm_head.weight is back.embed.weight
    want = {k: materialized(v) for k, v in model.state_dict().items()}
    got = back.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def _save_mamba2(path) -> None:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, state_size=16,
                       head_dim=16, num_heads=8, n_groups=1, expand=2, conv_kernel=4,
                       chunk_size=16, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       tie_word_embeddings=True)
    Mamba2ForCausalLM(cfg).eval().save_pretrained(path)  # embeddings tied to the head


@needs_ops
@pytest.mark.parametrize("kind", ["int8", "bf16"])
@pytest.mark.parametrize("family", ["mamba2", "granitemoehybrid", "qwen3_next"])
def test_compact_on_load_matches_converting_after(family, kind, tmp_path, monkeypatch):
    """``load_model(compact=...)`` (what the engine does for int8 / bf16 on the CPU) makes the
    large weights compact as each tensor is read: the same copies, routes and tokens as loading
    in float32 and converting after, with no float32 copy of them at any point; no parameter
    refers to the checkpoint's mapped file afterwards."""
    if family == "mamba2":
        _save_mamba2(tmp_path)
    else:
        FAMILIES[family].save_tiny(tmp_path)
    monkeypatch.setattr(lp, "compact_on_load", functools.partial(lp.compact_on_load,
                                                                 min_numel=1))
    direct = load_model(tmp_path, compact=kind)
    tied = {id(p) for names in _tied(direct) for p in [direct.get_parameter(names[0])]}
    linears = [m for m in direct.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m.weight, CompactWeight) for m in linears
                           if id(m.weight) not in tied)  # a tied head waits for its embedding
    assert all(isinstance(p, CompactWeight) for m in direct.modules() if isinstance(m, Experts)
               for p in (m.w_in, m.down_proj))
    after = load_model(tmp_path)
    for model in (direct, after):
        _convert(model, kind, 1, release=True)
    info, want = lp.weight_precision(direct), lp.weight_precision(after)
    assert info == want and info["float32_kept_bytes"] == 0 and info["linears"]
    assert (info["experts"] > 0) == (family != "mamba2")
    if family == "mamba2":  # the tied head and embedding: one compact weight
        assert tied and isinstance(direct.lm_head.weight, CompactWeight)
        assert direct.lm_head.weight is direct.embed.weight
    _assert_same_tokens(direct, after)
    gc.collect()
    maps = Path("/proc/self/maps")
    if maps.is_file():
        assert str(tmp_path) not in maps.read_text()


def _tied(model: nn.Module) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def test_no_init_skips_initializers_in_its_thread_only():
    """``importing.no_init`` (the registry builds a model about to receive a checkpoint under
    it): the initializers leave tensors as they are in that thread, not in another one running
    meanwhile, and are themselves again afterwards."""
    import threading

    from mcserve.models.importing import no_init

    original = nn.init.normal_
    seen: dict[str, bool] = {}
    inside, checked = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait()
        seen["other"] = bool(nn.init.normal_(torch.zeros(64)).abs().sum() > 0)
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    with no_init():
        inside.set()
        checked.wait(timeout=30)
        with no_init():  # nested: still skipped
            seen["nested"] = bool(nn.init.ones_(torch.zeros(8)).sum() == 0)
        seen["this"] = bool(nn.init.normal_(torch.zeros(64)).abs().sum() == 0)
    t.join()
    assert seen == {"other": True, "nested": True, "this": True}
    assert nn.init.normal_ is original
    assert nn.init.normal_(torch.zeros(64)).abs().sum() > 0
