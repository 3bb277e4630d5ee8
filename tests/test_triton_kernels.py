"""The Triton kernels (run under ``TRITON_INTERPRET=1`` on CPU tensors), their torch twins, the
plain reference loops, ``reference.mc_linear`` end to end, the engine hook and the dispatch.

The interpreter needs ``TRITON_INTERPRET=1`` *before triton is imported* (triton's own
``tl.zeros``/``tl.sum``… are ``@jit`` functions decorated at import). This module sets it, imports
triton, and restores the variable; the fixture below sets it again for every test (our kernels
are decorated lazily at call time, ``mcserve.kernels.triton._jit``). If triton was already
imported in this process without it, the interpreter cannot work: ``tests/conftest.py`` sets the
variable before any test module imports torch or triton, so that does not happen in the suite.

Every output buffer the kernels write is pre-filled with NaN, and every pool row no table names
holds NaN: an element left unwritten, or a block read that should not be, fails the comparison.

On a machine with an NVIDIA GPU, ``MCSERVE_TEST_CUDA=1 pytest tests/test_triton_kernels.py``
runs the same comparisons with every tensor on the GPU and the kernels compiled (no
interpreter); ``tests/conftest.py`` then leaves ``TRITON_INTERPRET`` unset.
"""

from __future__ import annotations

import math
import os
import runpy
from pathlib import Path

# compiled kernels on CUDA tensors instead of the interpreter on CPU ones
CUDA_MODE = os.environ.get("MCSERVE_TEST_CUDA") == "1"
_saved = os.environ.get("TRITON_INTERPRET")
if not CUDA_MODE:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
    from triton.runtime.interpreter import InterpretedFunction

    _TRITON_ERR = None
    # triton's standard library was decorated for the interpreter iff it was imported with it
    _INTERP_OK = isinstance(triton.language.standard.zeros, InterpretedFunction)
except Exception as e:  # not installed / broken
    _TRITON_ERR = f"{type(e).__name__}: {e}"
    _INTERP_OK = False
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

import pytest  # noqa: E402
import torch  # noqa: E402

from mcserve.kernels import dispatch, reference  # noqa: E402
from mcserve.kernels.triton.common import boundary_layout  # noqa: E402
from mcserve.kernels.triton.linear_prefill import chunk_linear_prefill_reference  # noqa: E402
from mcserve.kernels.triton.mc_decode import (  # noqa: E402
    paged_mc_decode_linear_reference,
    paged_mc_decode_linear_torch,
)

ROOT = Path(__file__).resolve().parents[1]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
NAN = float("nan")

if CUDA_MODE:
    if not torch.cuda.is_available():
        raise RuntimeError("MCSERVE_TEST_CUDA=1 but torch sees no CUDA device")
    DEV = torch.device("cuda")
    _KERNELS_OK = _TRITON_ERR is None and not _INTERP_OK
else:
    DEV = torch.device("cpu")
    _KERNELS_OK = _INTERP_OK

needs_triton = pytest.mark.skipif(
    not _KERNELS_OK,
    reason=f"package 'triton' missing: {_TRITON_ERR}" if _TRITON_ERR is not None else
    "triton was imported with the wrong TRITON_INTERPRET setting earlier in this process "
    "(tests/conftest.py sets it before anything imports triton)")
interpreter_only = pytest.mark.skipif(
    CUDA_MODE, reason="about the CPU interpreter; this run compiles for the NVIDIA GPU")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("MCSERVE_KERNELS", raising=False)
    if CUDA_MODE:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _d(*ts):
    """Move test data (made on the CPU from seeded generators) to the device under test."""
    out = tuple(None if t is None else t.to(DEV) for t in ts)
    return out if len(out) != 1 else out[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all(), "non-finite (unwritten?) output"
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------ decode data


def _decode_case(seed, B, H, K, V, lens, dtype, *, per_head=False, extra_blocks=5,
                 strided_table=True, pool_dtype=None):
    """Ragged rows (``lens[b]`` cached blocks each, 0 allowed), block ids scattered over a pool
    whose unreferenced rows are NaN; the table is a non-contiguous view."""
    g = torch.Generator().manual_seed(seed)
    N = max(lens, default=0)
    total = sum(lens) * (H if per_head else 1)
    nb = total + extra_blocks
    perm = torch.randperm(nb, generator=g)
    pool = torch.full((nb, H, K, V), NAN, dtype=pool_dtype or dtype)
    ksum = torch.full((nb, H, K), NAN, dtype=dtype)
    shape = (B, H, N) if per_head else (B, N)
    big = torch.full(shape + (2,), -1, dtype=torch.long)  # [..., 0] is the table: strided
    nxt = 0
    for bi, n in enumerate(lens):
        for h in range(H if per_head else 1):
            for j in range(n):
                bid = int(perm[nxt])
                nxt += 1
                if per_head:
                    big[bi, h, j, 0] = bid
                else:
                    big[bi, j, 0] = bid
    used = perm[:nxt]
    pool[used] = torch.randn((len(used), H, K, V), generator=g, dtype=dtype).to(pool.dtype)
    ksum[used] = torch.randn((len(used), H, K), generator=g, dtype=dtype) * 3
    table = big[..., 0] if strided_table else big[..., 0].contiguous()
    q, u, p = (torch.randn(B, H, K, generator=g, dtype=dtype) for _ in range(3))
    o = torch.randn(B, H, V, generator=g, dtype=dtype)
    return _d(q, u, o, p, table, pool, ksum)


def _run_decode_all(args, check_ref=True, **kw):
    """Triton (NaN-filled out) vs torch twin vs reference loop."""
    q = args[0]
    out = torch.full((q.shape[0], q.shape[1], args[2].shape[-1]), NAN, dtype=q.dtype,
                     device=DEV)
    y_tr = dispatch.paged_mc_decode_linear(*args, out=out, backend="triton", **kw)
    assert y_tr is out
    y_tw = dispatch.paged_mc_decode_linear(*args, backend="torch", **kw)
    tol = TOL[q.dtype]
    assert _rel(y_tr, y_tw) < tol
    if check_ref:
        y_ref = dispatch.paged_mc_decode_linear(*args, backend="reference", **kw)
        assert _rel(y_tw, y_ref) < tol
    return y_tr


# ------------------------------------------------------------------------------ decode kernel


@needs_triton
@pytest.mark.parametrize("variant", ["residual", "post", "grm", "soup", "ssc"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_decode_ragged(variant, dtype):
    # rows with 3, 0 (empty cached list) and 5 blocks; K, V odd; scattered ids, strided table
    args = _decode_case(1, 3, 2, 5, 7, [3, 0, 5], dtype)
    _run_decode_all(args, variant=variant, segment_len=4, top_k=2)


@needs_triton
@pytest.mark.parametrize("variant", ["post", "grm", "ssc"])
def test_decode_per_head_table_state_table_nseg_vtiles(variant):
    # (B, H, N) table, states read from other rows than the key sums (staged host blocks),
    # n_seg given (post), V split over 2 programs
    q, u, o, p, table, pool, ksum = _decode_case(2, 2, 3, 6, 20, [4, 2], torch.float64,
                                                 per_head=True)
    nb = pool.shape[0]
    remap = _d(torch.randperm(nb, generator=torch.Generator().manual_seed(0)))
    pool2 = torch.full_like(pool, NAN)
    pool2[remap] = pool  # block id i now lives in row remap[i]
    state_table = torch.where(table >= 0, remap[table.clamp_min(0)], -1)
    n_seg = _d(torch.tensor([7, 2]))
    kw = dict(variant=variant, segment_len=3, top_k=3, n_seg=n_seg, state_table=state_table)
    args = (q, u, o, p, table, pool2, ksum)
    out = torch.full((2, 3, 20), NAN, dtype=torch.float64, device=DEV)
    from mcserve.kernels.triton.mc_decode.single import paged_mc_decode_linear as tri
    y_tr = tri(*args, out=out, block_v=16, **kw)
    y_tw = paged_mc_decode_linear_torch(*args, **kw)
    y_ref = paged_mc_decode_linear_reference(*args, **kw)
    assert _rel(y_tr, y_tw) < 1e-10 and _rel(y_tw, y_ref) < 1e-10
    # and the same as reading the un-remapped pool directly
    y_direct = paged_mc_decode_linear_torch(q, u, o, p, table, pool, ksum,
                                            **{**kw, "state_table": None})
    assert _rel(y_tw, y_direct) < 1e-12


@needs_triton
@pytest.mark.parametrize("variant", ["grm", "ssc", "post"])
def test_decode_no_cached_blocks(variant):
    # N = 0: y = o_online for grm/ssc (γ_on = 1) and post (n = 0)
    q, u, o, p, table, pool, ksum = _decode_case(3, 2, 2, 4, 4, [0, 0], torch.float32)
    assert table.shape == (2, 0)
    y = _run_decode_all((q, u, o, p, table, pool, ksum), variant=variant, segment_len=2)
    assert torch.allclose(y, o)


@needs_triton
def test_decode_ssc_ties_and_bf16_pool():
    # equal key sums in every block → equal scores: ssc keeps the most recent top_k columns
    q, u, o, p, table, pool, ksum = _decode_case(4, 2, 2, 4, 5, [5, 3], torch.float32,
                                                 pool_dtype=torch.bfloat16)
    ids = table[table >= 0]
    ksum[ids] = ksum[ids[0]].clone()
    args = (q, u, o, p, table, pool, ksum)
    y = _run_decode_all(args, variant="ssc", segment_len=4, top_k=2)
    # explicit: row 0 must read columns 3, 4 only; row 1 columns 1, 2
    keep = _d(torch.tensor([[-1, -1, -1, 1, 1], [-1, 1, 1, -1, -1]]))
    t2 = torch.where(keep > 0, table, -1)
    y_grm = paged_mc_decode_linear_torch(*((q, u, o, p, t2) + (pool, ksum)),
                                         variant="grm", segment_len=4)
    assert _rel(y, y_grm) < 1e-5
    idx, sc = dispatch.ssc_router(u, ksum, table, segment_len=4, top_k=2, backend="triton")
    assert idx.tolist() == [[[4, 3]] * 2, [[2, 1]] * 2]


@needs_triton
def test_decode_ssc_per_row_top_k():
    # per-request top_k overrides: row b keeps min(row_top_k[b], top_k) picks
    args = _decode_case(6, 4, 2, 5, 3, [5, 4, 0, 3], torch.float32)
    row_k = _d(torch.tensor([1, 3, 2, 0]))
    y = _run_decode_all(args, variant="ssc", segment_len=4, top_k=3, row_top_k=row_k)
    one = paged_mc_decode_linear_torch(*args, variant="ssc", segment_len=4, top_k=1)
    assert _rel(y[0], one[0]) < 1e-5  # row 0 (k = 1) as with top_k = 1
    assert _rel(y[3], args[2][3]) < 1e-6  # row 3 (k = 0): the online memory only


# ------------------------------------------------------------------------------ router


@needs_triton
@pytest.mark.parametrize("top_k", [1, 3, 6])
@pytest.mark.parametrize("per_head", [False, True], ids=["table2d", "table3d"])
def test_router(top_k, per_head):
    q, u, o, p, table, pool, ksum = _decode_case(5 + top_k, 3, 2, 5, 3, [4, 0, 5],
                                                 torch.float64, per_head=per_head)
    res = {bk: dispatch.ssc_router(u, ksum, table, segment_len=3, top_k=top_k, backend=bk)
           for bk in ("triton", "torch", "reference")}
    idx, sc = res["reference"]
    for bk in ("triton", "torch"):
        assert torch.equal(res[bk][0], idx), bk
        fin = torch.isfinite(sc)
        assert torch.equal(torch.isfinite(res[bk][1]), fin)
        assert torch.allclose(res[bk][1][fin], sc[fin], rtol=1e-12, atol=1e-12)
    assert (idx[1] == -1).all()  # the row without cached blocks
    if top_k > 4:
        assert (idx[0, :, 4:] == -1).all() and (idx[2, :, 5:] == -1).all()
    # per-row pick counts
    row_k = _d(torch.tensor([2, 1, 0]))
    res = {bk: dispatch.ssc_router(u, ksum, table, segment_len=3, top_k=top_k, row_top_k=row_k,
                                   backend=bk) for bk in ("triton", "torch", "reference")}
    for bk in ("triton", "torch"):
        assert torch.equal(res[bk][0], res["reference"][0]), bk
    assert (res["triton"][0][2] == -1).all() and (res["triton"][0][0, :, 2:] == -1).all()
    assert torch.equal(res["triton"][0][0, :, :min(2, top_k)], idx[0, :, :min(2, top_k)])


def test_router_matches_decode_paged_select():
    # the router's order is MCMemory._select's order (ties → more recent)
    from mcserve.config import MCConfig
    from mcserve.kernels.triton.ssc_router.twin import _select
    from mcserve.models.mc import MCMemory
    from mcserve.models.memory.linear import LinearMemory

    mc = MCMemory(LinearMemory(), MCConfig(variant="ssc", segment_len=4, top_k=3))
    r = torch.tensor([[[0.5, 0.2, 0.5, 0.1, 0.2]]]).permute(0, 2, 1)[:, None]  # (1, 1, 5, 1)
    want = mc._select(r, 3)[0, 0, :, 0].tolist()
    assert _select(r[0, 0].T[None], 3)[0, 0].tolist() == want == [2, 0, 4]


# ------------------------------------------------------------------------------ prefill


def _prefill_data(seed, B, T, H, K, V, dtype, gated=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    la = -torch.rand(B, T, H, generator=g, dtype=dtype) * 0.5 if gated else None
    b = torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    return _d(q, k, v, la, b) + (g,)


def _check_prefill(args, kw, n_seq, H, K, V, dtype, pool_rows=None):
    """Run all three backends into NaN-filled buffers / pools and compare everything."""
    q = args[0]
    res = {}
    for bk in ("triton", "torch", "reference"):
        kk = dict(kw)
        if pool_rows is not None:
            kk["state_pool"] = torch.full((pool_rows, H, K, V), NAN, dtype=dtype, device=DEV)
            kk["ksum_pool"] = torch.full((pool_rows, H, K), NAN, dtype=dtype, device=DEV)
        out = torch.full(q.shape[:3] + (V,), NAN, dtype=dtype, device=DEV)
        res[bk] = dispatch.chunk_linear_prefill(*args, out=out, backend=bk, **kk)
        assert res[bk][0] is out
    tol = TOL[dtype]
    ids = kw.get("block_ids")
    for bk in ("triton", "torch"):
        o, fin, bs, bks = res[bk]
        o_r, fin_r, bs_r, bks_r = res["reference"]
        assert _rel(o, o_r) < tol, bk
        assert _rel(fin, fin_r) < tol, bk
        if ids is not None:  # written rows match, every other pool row is still NaN
            untouched = torch.ones(bs.shape[0], dtype=torch.bool, device=DEV)
            untouched[ids] = False
            assert torch.isnan(bs[untouched]).all() and torch.isnan(bks[untouched]).all()
            bs, bks, bs_r, bks_r = bs[ids], bks[ids], bs_r[ids], bks_r[ids]
        if bs.numel():
            assert _rel(bs, bs_r) < tol, bk
            assert _rel(bks, bks_r) < tol, bk
    return res["triton"]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_prefill_fixed_batch(dtype):
    # T = 37 not a multiple of C = 5; segments shorter than the chunk; gates on
    q, k, v, la, b, _ = _prefill_data(10, 2, 37, 2, 5, 6, dtype)
    o, fin, bs, bks = _check_prefill((q, k, v, la, b), dict(segment_len=5, chunk_size=16),
                                     2, 2, 5, 6, dtype)
    assert bs.shape == (2 * 7, 2, 5, 6) and bks.shape == (14, 2, 5)
    # key sums are plain sums of k over each segment; row-major (sequence, boundary)
    assert torch.allclose(bks[7 + 2], k[1, 10:15].sum(0), atol=1e-5)


@needs_triton
def test_prefill_long_segments_initial_state_vtiles():
    # C = 20 > chunk 16: several chunks per segment; no gates; initial state; V in 2 tiles
    q, k, v, _, _, g = _prefill_data(11, 1, 45, 1, 4, 20, torch.float64, gated=False)
    h0 = _d(torch.randn(1, 1, 4, 20, generator=g, dtype=torch.float64))
    from mcserve.kernels.triton.linear_prefill.scan import chunk_linear_prefill as tri
    o, fin, bs, bks = tri(q, k, v, None, None, h0, segment_len=20, chunk_size=16, block_v=16)
    r = chunk_linear_prefill_reference(q, k, v, None, None, h0, segment_len=20)
    for x, y in zip((o, fin, bs, bks), r):
        assert _rel(x, y) < 1e-10


@needs_triton
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_prefill_varlen_into_pool(mode):
    # 5 sequences: 3 (< C), 0 (empty), 12, 11, 1 tokens; per-sequence offsets into their
    # current segment with their key sums; boundaries land at scattered ids of a NaN pool
    dtype = torch.float32
    cu = _d(torch.tensor([0, 3, 3, 15, 26, 27]))
    T, H, K, V, C = 27, 2, 3, 5, 4
    q, k, v, la, b, g = _prefill_data(12, 1, T, H, K, V, dtype)
    h0 = _d(torch.randn(5, H, K, V, generator=g, dtype=dtype))
    off = _d(torch.tensor([1, 0, 3, 2, 3]))
    ks0 = _d(torch.randn(5, H, K, generator=g, dtype=dtype))
    counts, offsets = boundary_layout(cu[1:] - cu[:-1], C, off)
    assert counts.tolist() == [1, 0, 3, 3, 1]
    total = int(counts.sum())
    ids = _d(torch.randperm(total + 6, generator=g)[:total])
    kw = dict(segment_len=C, cu_seqlens=cu, mode=mode, initial_seg_len=off, initial_ksum=ks0,
              block_ids=ids)
    o, fin, bs, bks = _check_prefill((q, k, v, la, b, h0), kw, 5, H, K, V, dtype,
                                     pool_rows=total + 6)
    # sequence 0: 3 tokens complete its segment (1 + 3 = C): key sum = ks0 + Σ k
    assert torch.allclose(bks[ids[0]], ks0[0] + k[0, 0:3].sum(0), atol=1e-5)
    # sequence 1 (empty): final state = initial state
    assert torch.equal(fin[1], h0[1])
    if mode == "independent":  # sequence 4 ends exactly on a boundary: restarted from zero
        assert (fin[4] == 0).all()


@needs_triton
def test_prefill_shorter_than_segment():
    q, k, v, la, b, _ = _prefill_data(13, 3, 3, 1, 2, 3, torch.float64)
    o, fin, bs, bks = _check_prefill((q, k, v, la, b), dict(segment_len=8), 3, 1, 2, 3,
                                     torch.float64)
    assert bs.shape[0] == 0 and bks.shape[0] == 0


# ------------------------------------------------------------------------------ vs the oracle

E2E = [
    pytest.param("grm", "checkpoint", 11, 4, 2, torch.float64, id="grm-ckpt-T11C4-f64"),
    pytest.param("ssc", "independent", 13, 3, 2, torch.float32, id="ssc-indep-T13C3-f32"),
    pytest.param("post", "independent", 9, 4, 2, torch.float64, id="post-indep-T9C4-f64"),
    pytest.param("residual", "checkpoint", 3, 5, 2, torch.float32, id="residual-T3<C5-f32"),
    pytest.param("soup", "checkpoint", 12, 4, 1, torch.float64, id="soup-T12C4-f64"),
]


def _mc_data(seed, T, H, K, V, dtype):
    g = torch.Generator().manual_seed(seed)
    q, k, u = (torch.randn(T, H, K, generator=g, dtype=dtype) for _ in range(3))
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    a = torch.rand(T, H, generator=g, dtype=dtype) * 0.5 + 0.5
    b = torch.rand(T, H, generator=g, dtype=dtype)
    return _d(q, k, v, u, a, b)


@needs_triton
@pytest.mark.parametrize("variant,mode,T,C,top_k,dtype", E2E)
def test_kernels_match_reference_mc_linear(variant, mode, T, C, top_k, dtype):
    q, k, v, u, a, b = _mc_data(T * 7 + C, T, 2, 5, 3, dtype)
    want = reference.mc_linear(q, k, v, u, a, b, variant=variant, segment_len=C, top_k=top_k,
                               mode=mode)
    nb = T // C
    ids = _d(torch.randperm(nb + 3, generator=torch.Generator().manual_seed(1))[:nb])
    got = dispatch.mc_linear(q, k, v, u, a, b, variant=variant, segment_len=C, top_k=top_k,
                             mode=mode, backend="triton", block_ids=ids, num_blocks=nb + 3)
    assert _rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("variant", ["residual", "post", "grm", "soup", "ssc"])
@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_twins_match_reference_mc_linear(variant, mode):
    q, k, v, u, a, b = _mc_data(3, 14, 2, 4, 3, torch.float64)
    want = reference.mc_linear(q, k, v, u, a, b, variant=variant, segment_len=3, top_k=2,
                               mode=mode)
    for bk in ("torch", "reference"):
        got = dispatch.mc_linear(q, k, v, u, a, b, variant=variant, segment_len=3, top_k=2,
                                 mode=mode, backend=bk)
        assert _rel(got, want) < 1e-10, bk


# ------------------------------------------------------------------------------ engine hook


def _paged_layer(family_name, variant, seed, lens, C=4, top_k=2, H=2, K=4, V=3, fetch=False,
                 row_top_k=None):
    from mcserve.config import MCConfig
    from mcserve.models.mc import MCMemory
    from mcserve.models.mc_state import PagedLayer
    from mcserve.models.memory.linear import LinearMemory, SWLAMemory

    g = torch.Generator().manual_seed(seed)
    fam = LinearMemory() if family_name == "linear" else SWLAMemory()
    mc = MCMemory(fam, MCConfig(variant=variant, segment_len=C, top_k=top_k))
    B = len(lens)
    N = max(lens)
    n_dev = sum(lens) + 2
    ids = torch.randperm(n_dev, generator=g)
    table = torch.full((B, N), -1, dtype=torch.long)
    j = 0
    for bi, n in enumerate(lens):
        table[bi, :n] = ids[j:j + n]
        j += n
    pool = torch.randn(n_dev, H, K, V, generator=g, dtype=torch.float64)
    ksum = torch.randn(n_dev, H, K, generator=g, dtype=torch.float64) * 3
    fetch_fn = None
    if fetch:  # move the first row's blocks to a "host tier": ids >= host_base, staged rows
        n_host = lens[0]
        host_base = n_dev + n_host
        staged = torch.full((host_base, H, K, V), NAN, dtype=torch.float64)
        staged[:n_dev] = pool
        ksum_u = torch.full((host_base + n_dev, H, K), NAN, dtype=torch.float64)
        ksum_u[:n_dev] = ksum
        lut = {}
        for col in range(n_host):
            bid = int(table[0, col])
            hid = host_base + bid
            ksum_u[hid] = ksum[bid]
            lut[hid] = (bid, n_dev + col)
            table[0, col] = hid
            staged[bid] = 1e3  # stale device copy: the right data comes only via fetch
        host_pool = pool.clone()

        def fetch_fn(x, head_dim):
            out = x.clone()
            for hid, (bid, row) in lut.items():
                m = x == hid
                if m.any():
                    staged[row] = host_pool[bid]
                    out[m] = row
            return out

        # the closure reads these names when called: it sees the device copies
        staged, host_pool = _d(staged, host_pool)
        pool, ksum = staged, ksum_u
    pool, ksum, table = _d(pool, ksum, table)
    mem = fam.init_state(B, H, K, V, dtype=torch.float64, device="cpu")
    mem = {key: _d(torch.randn(t.shape, generator=g, dtype=t.dtype)) for key, t in mem.items()}
    pl = PagedLayer(mem=mem, conv=None, seg_ksum=_d(torch.randn(B, H, K, generator=g,
                                                                dtype=torch.float64)),
                    seg_len=_d(torch.randint(0, C - 1, (B,), generator=g)),
                    n_seg=_d(torch.tensor(lens)), csum=None, table=table, pool={"S": pool},
                    ksum_pool=ksum, fetch=fetch_fn)
    if row_top_k is not None:
        pl.top_k = _d(torch.tensor(row_top_k))
    x = {n: _d(torch.randn(B, 1, H, K, generator=g, dtype=torch.float64)) for n in "qku"}
    x["v"] = _d(torch.randn(B, 1, H, V, generator=g, dtype=torch.float64))
    gates = {"log_a": -_d(torch.rand(B, 1, H, generator=g, dtype=torch.float64)),
             "b": _d(torch.rand(B, 1, H, generator=g, dtype=torch.float64))}
    if family_name == "swla":
        gates["c"] = _d(torch.rand(B, 1, H, generator=g, dtype=torch.float64))
    return mc, pl, x, gates


def _copy_pl(pl):
    from dataclasses import replace

    return replace(pl, mem={k: t.clone() for k, t in pl.mem.items()},
                   seg_ksum=pl.seg_ksum.clone())


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("family,variant,fetch,row_k", [
    ("linear", "grm", False, None), ("linear", "ssc", False, None),
    ("swla", "soup", False, None), ("linear", "ssc", True, None), ("swla", "grm", True, None),
    ("linear", "ssc", False, [1, 4, 2, 3]), ("linear", "ssc", True, [3, 1, 1, 2]),
])
def test_decode_paged_linear_hook_matches_engine(backend, family, variant, fetch, row_k):
    # MCMemory.decode_paged_kernels (decode over the kernels, the engine's CUDA path) ==
    # decode_paged (the torch path)
    mc, pl, x, gates = _paged_layer(family, variant, 21, [5, 0, 2, 3], fetch=fetch,
                                    row_top_k=row_k)
    pl_a, pl_b = _copy_pl(pl), _copy_pl(pl)
    want = mc.decode_paged(pl_a, x["q"], x["k"], x["v"], x["u"], gates)
    got = mc.decode_paged_kernels(pl_b, x["q"], x["k"], x["v"], x["u"], gates, backend=backend)
    assert _rel(got, want) < 1e-10
    assert torch.equal(pl_a.seg_ksum, pl_b.seg_ksum)
    for key in pl_a.mem:
        assert torch.allclose(pl_a.mem[key], pl_b.mem[key], rtol=0, atol=0)


# ------------------------------------------------------------------------------ dispatch


def test_dispatch_defaults_and_override(monkeypatch):
    x = torch.zeros(1)
    assert dispatch.get_backend(x) == "torch"  # CPU tensors: the torch twin
    if CUDA_MODE:  # CUDA tensors: the Triton kernels
        assert dispatch.get_backend(torch.zeros(1, device=DEV)) == "triton"
    assert dispatch.get_backend() == "torch"
    monkeypatch.setenv("MCSERVE_KERNELS", "reference")
    assert dispatch.get_backend(x) == "reference"
    monkeypatch.setenv("MCSERVE_KERNELS", "bogus")
    with pytest.raises(ValueError, match="MCSERVE_KERNELS"):
        dispatch.get_backend(x)
    monkeypatch.setenv("MCSERVE_KERNELS", "torch")
    q, u, o, p, table, pool, ksum = _decode_case(0, 2, 1, 3, 2, [1, 2], torch.float64)
    y = dispatch.paged_mc_decode_linear(q, u, o, p, table, pool, ksum, variant="grm",
                                        segment_len=2)
    assert torch.isfinite(y).all()


@needs_triton
@interpreter_only
def test_dispatch_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("MCSERVE_KERNELS", "triton")
    assert dispatch.get_backend(torch.zeros(1)) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    q, u, o, p, table, pool, ksum = _decode_case(0, 1, 1, 3, 2, [1], torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.paged_mc_decode_linear(q, u, o, p, table, pool, ksum, variant="grm",
                                        segment_len=2)


@needs_triton
@interpreter_only
def test_kernels_follow_env_at_call_time(monkeypatch):
    # our kernels are decorated per interpreter setting at call time, not at import
    from triton.runtime.interpreter import InterpretedFunction

    from mcserve.kernels.triton._jit import jitted
    from mcserve.kernels.triton.mc_decode import single

    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = jitted(single._paged_decode_kernel)
    assert not isinstance(compiled, InterpretedFunction)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(jitted(single._paged_decode_kernel), InterpretedFunction)
    q, u, o, p, table, pool, ksum = _decode_case(0, 1, 1, 3, 2, [2], torch.float32)
    y = single.paged_mc_decode_linear(q, u, o, p, table, pool, ksum, variant="grm",
                                      segment_len=2)
    assert _rel(y, paged_mc_decode_linear_torch(q, u, o, p, table, pool, ksum,
                                                variant="grm", segment_len=2)) < 1e-5


def test_bench_without_cuda_exits_cleanly(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the bench would run")
    mod = runpy.run_path(str(ROOT / "bench" / "kernels.py"), run_name="bench_kernels")
    assert mod["main"]([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_bandwidth_floor_bytes():
    # the bench's byte counts (what a kernel must at least move)
    mod = runpy.run_path(str(ROOT / "bench" / "kernels.py"), run_name="bench_kernels")
    got = mod["decode_bytes"](B=2, H=4, K=8, V=8, n_read=3, elt=4)
    want = 4 * (2 * 4 * (3 * 8 * 8 + 3 * 8 + 3 * 8 + 2 * 8))
    assert got == want and math.isfinite(got)


@pytest.mark.parametrize("backend", [
    pytest.param("triton", marks=needs_triton), "reference"])
@pytest.mark.parametrize("variant,mode", [("grm", "checkpoint"), ("ssc", "independent"),
                                          ("post", "independent")])
@pytest.mark.parametrize("T", [13, 21])  # ends inside a segment / exactly on a boundary
def test_mc_chunk_online_term_through_the_prefill_kernel(monkeypatch, backend, variant, mode, T):
    """``mc_linear_chunk`` takes its online term and boundary states from
    ``dispatch.chunk_linear_prefill`` on a kernel backend: same outputs as the torch fold."""
    from mcserve.config import MCConfig
    from mcserve.kernels.mc_chunk import mc_linear_chunk

    g = torch.Generator().manual_seed(T)
    B, H, K, V, C, f0 = 2, 3, 4, 5, 8, 3
    r = lambda *s: _d(torch.randn(*s, generator=g, dtype=torch.float64))  # noqa: E731
    q, k, u, v = r(B, T, H, K), r(B, T, H, K) / 2, r(B, T, H, K), r(B, T, H, V)
    log_a = _d(-torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.3)
    b = _d(torch.rand(B, T, H, generator=g, dtype=torch.float64))
    N = 1 if variant == "post" else 3
    st = dict(initial_state=r(B, H, K, V), initial_ksum=r(B, H, K), initial_fill=f0,
              cached=r(B, N, H, K, V), cached_ksum=r(B, N, H, K), n_segments=3)
    mc = MCConfig(variant=variant, mode=mode, segment_len=C, top_k=1)
    monkeypatch.delenv("MCSERVE_KERNELS", raising=False)
    want = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
    monkeypatch.setenv("MCSERVE_KERNELS", backend)
    got = mc_linear_chunk(q, k, v, u, log_a, b, mc=mc, **st)
    for x, w in zip(got, want, strict=True):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-10)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("L,n_carried,K,V", [(150, 3, 5, 6), (37, 0, 16, 70), (8, 2, 8, 8)],
                         ids=["3-tiles-odd-dims", "no-carried-2-vtiles", "one-short-tile"])
def test_mc_chunk_readout_matches_twin(dtype, L, n_carried, K, V):
    """The fused readout of a prefill chunk against its torch twin (``_readout_blocks``): random
    states, weights zero where a token cannot see a checkpoint, several heads, token tiles that
    end mid-segment, V split into tiles; the output starts as NaN, so an unwritten element
    fails."""
    from mcserve.kernels.mc_chunk import _readout_blocks
    from mcserve.kernels.triton.readout import mc_chunk_readout

    g = torch.Generator().manual_seed(L + K)
    B, H, C = 2, 3, 4
    N = n_carried + (L - 1) // C
    S = torch.randn(B, N, H, K, V, generator=g, dtype=dtype)
    q = torch.randn(B, L, H, K, generator=g, dtype=dtype)
    vis = torch.arange(N)[None, :] < (n_carried + torch.arange(L) // C)[:, None]  # (L, N)
    w = torch.rand(B, L, H, N, generator=g, dtype=dtype) * vis[None, :, None, :]
    want = _readout_blocks(S, q, w, n_carried, C)
    out = _d(torch.full((B, L, H, V), NAN, dtype=dtype))
    got = mc_chunk_readout(*_d(S, q, w), n_carried, C, out=out)
    assert got is out
    assert _rel(got.cpu(), want) < TOL[dtype]
    # no checkpoints at all
    none = mc_chunk_readout(*_d(S[:, :0], q, w[..., :0]), 0, C)
    assert torch.equal(none.cpu(), torch.zeros(B, L, H, V, dtype=dtype))


@needs_triton
@pytest.mark.parametrize("H,Hkv,D,bs", [(4, 4, 16, 4), (6, 2, 24, 16), (8, 1, 64, 8)])
def test_paged_attention_decode_matches_naive(monkeypatch, H, Hkv, D, bs):
    """Hybrids' decode attention over the paged KV pool (``MCSERVE_KERNELS=triton``) against
    the naive twin: ragged rows over scattered and shared blocks, a partial last block, NaN in
    every pool row no length reaches."""
    from mcserve.kernels import attention as attn

    g = torch.Generator().manual_seed(H * D + bs)
    NB = 12
    k_pool = torch.randn(NB, bs, Hkv, D, generator=g)
    v_pool = torch.randn(NB, bs, Hkv, D, generator=g)
    tables = torch.tensor([[3, 7, 1, -1], [0, -1, -1, -1], [5, 2, 9, 11], [3, 7, 8, -1]])
    lengths = torch.tensor([2 * bs + 1, 1, 4 * bs, 3 * bs - 2])
    used = {(int(tables[b, t // bs]), t % bs) for b in range(4) for t in range(int(lengths[b]))}
    for blk in range(NB):
        for row in range(bs):
            if (blk, row) not in used:
                k_pool[blk, row] = NAN
                v_pool[blk, row] = NAN
    q = torch.randn(4, 1, H, D, generator=g)
    want = attn.naive_paged_decode(q, k_pool, v_pool, tables, lengths, D ** -0.5)
    monkeypatch.setenv("MCSERVE_KERNELS", "triton")
    got = attn.paged_decode(*_d(q, k_pool, v_pool, tables, lengths), D ** -0.5)
    assert _rel(got.cpu(), want) < TOL[torch.float32]
