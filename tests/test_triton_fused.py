"""The GPU decode-step kernels under ``TRITON_INTERPRET=1`` on CPU tensors, against their twins:
the split-N (flash-decoding) MC readout, the chunk-parallel prefill and the fused per-layer
decode (gated linear memory and Mamba2's mixer step).

The interpreter setup, the device switch (``MCSERVE_TEST_CUDA=1`` runs everything compiled on
the GPU) and the data helpers are those of ``tests/test_triton_kernels.py``. Every output is
pre-filled with NaN and every pool row no table names holds NaN: an unwritten element or a
stray read fails the comparison. Sizes are tiny (interpreted Triton is slow), lengths odd,
several heads.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_kernels import (  # the interpreter is set up by importing it first
    DEV,
    NAN,
    TOL,
    _check_prefill,
    _d,
    _decode_case,
    _prefill_data,
    _rel,
    needs_triton,
)

from mcserve.kernels import dispatch
from mcserve.kernels.triton import twins


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    import test_triton_kernels as base

    monkeypatch.delenv("MCSERVE_KERNELS", raising=False)
    if base.CUDA_MODE:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ------------------------------------------------------------------------------ split-N decode


@needs_triton
@pytest.mark.parametrize("variant", ["grm", "soup", "post", "residual", "ssc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_split_decode_matches_twin(variant, dtype):
    # ragged rows with 7, 0 and 13 blocks split in 4-column pieces (one split of row 0 half
    # empty, row 1 all empty); K, V odd; V over 2 tiles; scattered ids, strided table
    args = _decode_case(31, 3, 2, 5, 19, [7, 0, 13], dtype)
    kw = dict(variant=variant, segment_len=4, top_k=3)
    out = torch.full((3, 2, 19), NAN, dtype=dtype, device=DEV)
    from mcserve.kernels.triton.split import paged_mc_decode_linear_split

    y = paged_mc_decode_linear_split(*args, out=out, block_n=4, block_v=16, **kw)
    assert y is out
    want = twins.paged_mc_decode_linear_torch(*args, **kw)
    assert _rel(y, want) < TOL[dtype]


@needs_triton
def test_split_decode_per_head_table_state_table_nseg():
    q, u, o, p, table, pool, ksum = _decode_case(32, 2, 3, 4, 6, [9, 2], torch.float64,
                                                 per_head=True)
    remap = _d(torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(3)))
    pool2 = torch.full_like(pool, NAN)
    pool2[remap] = pool
    stab = torch.where(table >= 0, remap[table.clamp_min(0)], -1)
    n_seg = _d(torch.tensor([11, 2]))
    from mcserve.kernels.triton.split import paged_mc_decode_linear_split

    for variant in ("grm", "post"):
        kw = dict(variant=variant, segment_len=3, n_seg=n_seg, state_table=stab)
        y = paged_mc_decode_linear_split(q, u, o, p, table, pool2, ksum, block_n=2, **kw)
        want = twins.paged_mc_decode_linear_torch(q, u, o, p, table, pool2, ksum, **kw)
        assert _rel(y, want) < 1e-10, variant


def test_split_heuristic_and_dispatch_impl():
    from mcserve.kernels.triton import split

    assert split.use_split(1, 8, 64, 256, "grm")
    assert not split.use_split(1, 8, 64, 256, "ssc")  # reads top_k blocks only
    assert not split.use_split(64, 8, 64, 256, "grm")  # the batch fills the GPU
    assert not split.use_split(1, 8, 64, 8, "grm")  # few blocks: one walk is short
    assert split.split_blocks(1, 8, 64, 256) * 32 >= 256
    args = _decode_case(0, 1, 1, 3, 2, [1], torch.float64)
    with pytest.raises(ValueError, match="impl"):
        dispatch.paged_mc_decode_linear(*args, variant="grm", segment_len=2, impl="bogus")


@needs_triton
def test_dispatch_picks_split_for_batch1_many_blocks():
    # B = 1, N = 40 ≥ SPLIT_MIN_BLOCKS: the default goes through the split kernels
    args = _decode_case(33, 1, 1, 3, 2, [40], torch.float32)
    y = dispatch.paged_mc_decode_linear(*args, variant="grm", segment_len=4, backend="triton")
    want = twins.paged_mc_decode_linear_torch(*args, variant="grm", segment_len=4)
    assert _rel(y, want) < 1e-4


# ------------------------------------------------------------------------------ chunk prefill


def _prefill_both(args, kw, n_seq, H, K, V, dtype, pool_rows=None):
    """The chunk-parallel kernel (through dispatch's default) and the walking kernel, each
    against the twin and the reference (``_check_prefill``); then against each other."""
    a = _check_prefill(args, kw, n_seq, H, K, V, dtype, pool_rows)  # impl="chunk" by default
    from mcserve.kernels.triton.prefill import chunk_linear_prefill as scan

    kk = dict(kw)
    if pool_rows is not None:
        kk["state_pool"] = torch.full((pool_rows, H, K, V), NAN, dtype=dtype, device=DEV)
        kk["ksum_pool"] = torch.full((pool_rows, H, K), NAN, dtype=dtype, device=DEV)
    b = scan(*args, **kk)
    ids = kw.get("block_ids")
    for x, y, i in zip(a, b, range(4)):
        if i >= 2 and ids is not None:
            x, y = x[ids], y[ids]
        if x is not None and x.numel():
            assert _rel(x, y) < TOL[dtype], i
    return a


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_chunk_prefill_fixed_batch_many_chunks(dtype):
    # T = 45 over chunks of 16 (C = 20: two full chunks and a 4-token one per segment, a
    # 5-token tail), 3 heads, K, V odd, V in 2 tiles; gated
    q, k, v, la, b, g = _prefill_data(40, 2, 45, 3, 5, 19, dtype)
    h0 = _d(torch.randn(2, 3, 5, 19, generator=g, dtype=dtype))
    from mcserve.kernels.triton.chunk import chunk_linear_prefill_chunked as chunked

    res = chunked(q, k, v, la, b, h0, segment_len=20, chunk_size=16, block_v=16,
                  out=torch.full((2, 45, 3, 19), NAN, dtype=dtype, device=DEV))
    want = twins.chunk_linear_prefill_torch(q, k, v, la, b, h0, segment_len=20)
    for x, y in zip(res, want):
        assert _rel(x, y) < TOL[dtype]
    _prefill_both((q, k, v, la, b, h0), dict(segment_len=7, chunk_size=16), 2, 3, 5, 19, dtype)


@needs_triton
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_chunk_prefill_varlen_into_pool(mode):
    # 5 sequences (3, 0, 12, 11, 1 tokens), per-sequence offsets and key sums, boundaries at
    # scattered rows of a NaN pool; no gates on one run, both on the other
    dtype = torch.float32
    cu = _d(torch.tensor([0, 3, 3, 15, 26, 27]))
    T, H, K, V, C = 27, 2, 3, 5, 4
    q, k, v, la, b, g = _prefill_data(41, 1, T, H, K, V, dtype)
    h0 = _d(torch.randn(5, H, K, V, generator=g, dtype=dtype))
    off = _d(torch.tensor([1, 0, 3, 2, 3]))
    ks0 = _d(torch.randn(5, H, K, generator=g, dtype=dtype))
    total = int(twins.boundary_layout(cu[1:] - cu[:-1], C, off)[0].sum())
    ids = _d(torch.randperm(total + 6, generator=g)[:total])
    kw = dict(segment_len=C, cu_seqlens=cu, mode=mode, initial_seg_len=off, initial_ksum=ks0,
              block_ids=ids)
    _prefill_both((q, k, v, la, b, h0), kw, 5, H, K, V, dtype, pool_rows=total + 6)
    _prefill_both((q, k, v, None, None, h0), kw, 5, H, K, V, dtype, pool_rows=total + 6)


@needs_triton
def test_chunk_prefill_short_and_empty():
    # every sequence shorter than a segment (no boundary), and an all-empty varlen batch
    q, k, v, la, b, _ = _prefill_data(42, 3, 3, 2, 2, 3, torch.float64)
    o, fin, bs, bks = _prefill_both((q, k, v, la, b), dict(segment_len=8), 3, 2, 2, 3,
                                    torch.float64)
    assert bs.shape[0] == 0
    q0, k0, v0 = (x[:, :0] for x in (q[:1], k[:1], v[:1]))
    h0 = _d(torch.randn(2, 2, 2, 3, generator=torch.Generator().manual_seed(0),
                        dtype=torch.float64))
    cu = _d(torch.tensor([0, 0, 0]))
    o, fin, _, _ = dispatch.chunk_linear_prefill(q0, k0, v0, None, None, h0, segment_len=4,
                                                 cu_seqlens=cu, backend="triton")
    assert torch.equal(fin, h0)


def test_chunk_layout_cuts_at_boundaries():
    from mcserve.kernels.triton.chunk import chunk_layout

    lens = torch.tensor([10, 0, 5])
    off = torch.tensor([2, 0, 0])
    counts, offsets = twins.boundary_layout(lens, 4, off)  # boundaries at 2, 6, 10 | - | 4
    lay = dict(lens=lens, off=off, bos=torch.tensor([0, 10, 10]), offsets=offsets)
    cl = chunk_layout(lay, torch.tensor([7, 8, 9, 10]), 4, 16)
    assert cl["seq"].tolist() == [0, 0, 0, 2, 2]
    assert cl["t0"].tolist() == [0, 2, 6, 10, 14]
    assert cl["len"].tolist() == [2, 4, 4, 4, 1]
    assert cl["bid"].tolist() == [7, 8, 9, 10, -1]
    assert cl["c0"].tolist() == [0, 3, 3] and cl["nc"].tolist() == [3, 0, 2]
    with pytest.raises(ValueError, match="impl"):
        dispatch.chunk_linear_prefill(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1),
                                      torch.zeros(1, 1, 1, 1), segment_len=2, impl="bogus")
