"""The C++ decode kernels (mcserve/kernels/cpu/*.cpp) against their torch twins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcserve.kernels import cpu
from mcserve.kernels.cpu import twins

pytestmark = pytest.mark.skipif(
    cpu.ops() is None, reason=f"C++ CPU kernels unavailable: {cpu.status()}")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("rows,O,I,bias", [
    (1, 768, 256, False), (3, 257, 129, True), (8, 5, 33, True), (2, 1, 7, False)],
    ids=["b1-768x256", "b3-odd-bias", "b8-tiny", "b2-one-row"])
def test_gemv_matches_linear(rows, O, I, bias):
    g = torch.Generator().manual_seed(O * I)
    x = torch.randn(rows, I, generator=g)
    W = torch.randn(O, I, generator=g)
    b = torch.randn(O, generator=g) if bias else None
    got = cpu.ops().gemv(x, W, b)
    assert rel_err(got, twins.linear(x, W, b)) < 1e-5
    # the public wrapper: leading dims kept, more rows than the GEMV limit go to the twin
    x3 = torch.randn(rows, 1, I, generator=g)
    assert cpu.linear(x3, W, b).shape == (rows, 1, O)
    assert rel_err(cpu.linear(x3, W, b), twins.linear(x3, W, b)) < 1e-5
    xb = torch.randn(cpu.GEMV_MAX_ROWS + 1, I, generator=g)
    assert rel_err(cpu.linear(xb, W, b), twins.linear(xb, W, b)) < 1e-5


def test_gemv_rejects_bad_shapes():
    with pytest.raises(RuntimeError, match="gemv"):
        cpu.ops().gemv(torch.randn(2, 3), torch.randn(4, 5), None)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.ops().gemv(torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3), None)


@pytest.mark.parametrize("B,H,K,V,gates,view", [
    (1, 4, 64, 64, "ab", "plain"), (3, 2, 16, 24, "a", "pool-slice"),
    (2, 5, 8, 32, "b", "broadcast-qk"), (4, 3, 32, 16, "", "plain")],
    ids=["b1-h4", "pool-view-decay", "mamba-broadcast-write", "no-gates"])
def test_linear_step_matches_twin(B, H, K, V, gates, view):
    g = torch.Generator().manual_seed(B * 100 + H)
    if view == "pool-slice":  # rows of a bigger slot pool, updated where they live
        pool = torch.randn(B + 3, H, K, V, generator=g)
        S = pool[1:1 + B]
    else:
        S = torch.randn(B, H, K, V, generator=g)
    if view == "broadcast-qk":  # Mamba2: one group shared by every head (stride 0 on H)
        q = torch.randn(B, 1, K, generator=g).expand(B, H, K)
        k = torch.randn(B, 1, K, generator=g).expand(B, H, K)
    else:
        q, k = torch.randn(B, H, K, generator=g), torch.randn(B, H, K, generator=g)
    v = torch.randn(B, H, V, generator=g)
    log_a = -torch.rand(B, H, generator=g) if "a" in gates else None
    b = torch.rand(B, H, generator=g) if "b" in gates else None
    S_ref = S.clone()
    o_ref = twins.linear_step_(S_ref, q, k, v, log_a, b)
    o = cpu.linear_step_(S, q, k, v, log_a, b)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(S, S_ref) < 1e-6
    if view == "pool-slice":
        assert pool[0].abs().sum() > 0 and S.data_ptr() == pool[1].data_ptr()


def _step_inputs(op: str, B: int, H: int, K: int, V: int, gates: bool, view: str, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(pool, S, args after S) for one of the per-family state steps; S is rows 1..B of a bigger
    pool for ``view == "pool-slice"`` (stepped where it lives, as the engine's slot pool)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(B + 2, H, K, V, generator=g)
    S = pool[1:1 + B] if view == "pool-slice" else pool[:B].clone()

    def vec(n: int) -> torch.Tensor:
        if view == "broadcast":  # one group shared by every head (stride 0 on H)
            return torch.randn(B, 1, n, generator=g).expand(B, H, n)
        return torch.randn(B, H, n, generator=g)

    q, k = vec(K), vec(K) / K ** 0.5  # ‖k‖ about 1: the delta rule's normalised keys
    v = torch.randn(B, H, V, generator=g)
    if op == "delta_step_":
        args = (q, k, v, -torch.rand(B, H, generator=g) if gates else None,
                torch.rand(B, H, generator=g) * 2 if gates else None)
    elif op == "rwkv7_step_":
        kk = torch.nn.functional.normalize(torch.randn(B, H, K, generator=g), dim=-1)
        a_rate = torch.rand(B, H, K, generator=g)
        log_w = -torch.rand(B, H, K, generator=g) * 0.6  # RWKV-7: log w ≥ −e^{−0.5}
        args = (q, k, v, -kk, kk * a_rate, log_w)
    else:  # gla_vec_step_
        args = (q, k, v, -torch.rand(B, H, K, generator=g) if gates else None,
                torch.rand(B, H, generator=g) if gates else None)
    return pool, S, args


STEP_CASES = [(1, 3, 64, 64, True, "plain"), (5, 5, 16, 24, True, "pool-slice"),
              (5, 1, 8, 1, True, "broadcast"), (1, 7, 32, 128, False, "plain"),
              (5, 3, 128, 256, True, "pool-slice")]
STEP_IDS = ["b1-h3-64", "b5-h5-pool", "b5-v1-broadcast", "b1-h7-no-gates", "b5-gdn-head"]


@pytest.mark.parametrize("op", ["delta_step_", "rwkv7_step_", "gla_vec_step_"])
@pytest.mark.parametrize("B,H,K,V,gates,view", STEP_CASES, ids=STEP_IDS)
def test_state_step_matches_twin(op, B, H, K, V, gates, view):
    """Three tokens in a row, in place: the C++ op and its twin give the same outputs and
    states, and a pool-slice state is updated where it lives (neighbour rows untouched)."""
    pool, S, args = _step_inputs(op, B, H, K, V, gates, view, seed=B * 31 + H * 7 + K)
    S_ref, before = S.clone(), pool.clone()
    for _ in range(3):
        o = getattr(cpu.ops(), op)(S, *args)
        o_ref = getattr(twins, op)(S_ref, *args)
        assert o.shape == (B, H, V)
        assert rel_err(o, o_ref) < 1e-5
        assert rel_err(S, S_ref) < 1e-5
    if view == "pool-slice":
        assert S.data_ptr() == pool[1].data_ptr()
        assert torch.equal(pool[0], before[0]) and torch.equal(pool[B + 1], before[B + 1])
    # the public wrapper takes the C++ op for these inputs, the twin for float64 (same values)
    S2, S64 = S_ref.clone(), S_ref.double()
    o2 = getattr(cpu, op)(S2, *args)
    o64 = getattr(cpu, op)(S64, *(None if a is None else a.double() for a in args))
    assert rel_err(o2, o64.float()) < 1e-5 and rel_err(S2, S64.float()) < 1e-5


def test_state_step_twins_match_the_families_scans():
    """Each twin is one token of its family's recurrence as the chunked kernels define it."""
    from mcserve.kernels.delta import naive_delta_rule
    from mcserve.kernels.gla_vector import naive_gla_vec
    from mcserve.kernels.rwkv7 import naive_rwkv7

    B, H, K, V = 2, 3, 8, 12
    for op, naive in (("delta_step_", naive_delta_rule), ("rwkv7_step_", naive_rwkv7),
                      ("gla_vec_step_", naive_gla_vec)):
        _, S, args = _step_inputs(op, B, H, K, V, True, "plain", seed=3)
        t1 = [None if a is None else a[:, None] for a in args]  # (B, 1, H, ·)
        if op == "delta_step_":  # naive_delta_rule takes (beta, log_alpha)
            t1[3], t1[4] = t1[4], t1[3]
        o_want, S_want = naive(*t1, initial_state=S.clone())
        o = getattr(twins, op)(S, *args)
        assert rel_err(o, o_want[:, 0]) < 1e-6 and rel_err(S, S_want) < 1e-6


def test_state_step_twins_half_precision_in_float32():
    """A bfloat16 state is stepped in float32 and rounded once (as the chunked kernels do)."""
    for op in ("delta_step_", "rwkv7_step_"):
        _, S, args = _step_inputs(op, 2, 3, 16, 16, True, "plain", seed=5)
        Sh = S.bfloat16()
        S32 = Sh.float()
        o = getattr(twins, op)(Sh, *(None if a is None else a.bfloat16() for a in args))
        want = getattr(twins, op)(S32, *(None if a is None else a.bfloat16().float()
                                         for a in args))
        assert Sh.dtype == torch.bfloat16 and o.dtype == torch.bfloat16
        assert torch.equal(Sh, S32.bfloat16())
        assert rel_err(o.float(), want) < 1e-2


def test_state_steps_reject_bad_shapes():
    S = torch.randn(2, 3, 4, 5)
    q, v = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
    with pytest.raises(RuntimeError, match="delta_step_: k"):
        cpu.ops().delta_step_(S, q, torch.randn(2, 3, 5), v, None, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu.ops().gla_vec_step_(S.transpose(-1, -2), q, q, torch.randn(2, 3, 4), None, None)
    with pytest.raises(RuntimeError, match="rwkv7_step_: log_w"):
        cpu.ops().rwkv7_step_(S, q, q, v, q, q, torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="beta"):
        cpu.ops().delta_step_(S, q, q, v, None, torch.randn(3, 2))


@pytest.mark.parametrize("family", ["delta", "gated_delta", "rwkv7", "gla"])
def test_family_step_equals_one_token_scan(family):
    """``step_`` (what the engine's decode calls on its slot pool) equals ``scan`` of one token
    and leaves the state stepped in place."""
    from mcserve.models.memory.delta import DeltaMemory, GatedDeltaMemory
    from mcserve.models.memory.gla import VectorGatedMemory
    from mcserve.models.memory.rwkv7 import RWKV7Memory

    fam = {"delta": DeltaMemory(), "gated_delta": GatedDeltaMemory(), "rwkv7": RWKV7Memory(),
           "gla": VectorGatedMemory()}[family]
    g = torch.Generator().manual_seed(11)
    B, H, K, V = 5, 3, 16, 8
    S = torch.randn(B, H, K, V, generator=g)
    q = torch.randn(B, 1, H, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(B, 1, H, K, generator=g), dim=-1)
    v = torch.randn(B, 1, H, V, generator=g)
    per_key = torch.rand(B, 1, H, K, generator=g)
    gates = {"delta": {"beta": per_key[..., 0]},
             "gated_delta": {"beta": per_key[..., 0], "log_a": -per_key[..., 1]},
             "rwkv7": {"a": -k, "b": k * per_key, "log_w": -0.5 * per_key},
             "gla": {"log_a": -per_key, "b": per_key[..., 0]}}[family]
    o_want, st = fam.scan({"S": S}, q, k, v, gates)
    state = {"S": S.clone()}
    ptr = state["S"].data_ptr()
    o = fam.step_(state, q, k, v, gates)
    assert o.shape == (B, 1, H, V) and state["S"].data_ptr() == ptr
    assert rel_err(o, o_want) < 1e-5 and rel_err(state["S"], st["S"]) < 1e-5


@pytest.mark.parametrize("B,n,H,K,V", [(1, 16, 4, 64, 64), (3, 5, 2, 8, 24), (2, 0, 3, 4, 4)],
                         ids=["b1-16blocks", "odd", "no-blocks"])
def test_readout_paged_matches_twin(B, n, H, K, V):
    g = torch.Generator().manual_seed(n + 7)
    pool = torch.randn(20, H, K, V, generator=g)
    ids = torch.randint(0, 20, (B, n, H), generator=g)
    q = torch.randn(B, H, K, generator=g)
    w = torch.rand(B, n, H, generator=g)
    if n:
        w[0, 0, 0] = 0.0  # a zero weight (masked pick) contributes nothing
    got = cpu.readout_paged(pool, ids, q, w)
    want = twins.readout_paged(pool, ids, q, w)
    assert got.shape == (B, H, V)
    assert (got == 0).all() if n == 0 else rel_err(got, want) < 1e-5


def test_readout_paged_rejects_out_of_pool_ids():
    pool = torch.randn(4, 2, 3, 3)
    ids = torch.tensor([[[0, 9]]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.readout_paged(pool, ids, torch.randn(1, 2, 3), torch.ones(1, 1, 2))
    with pytest.raises(IndexError, match="outside the pool"):
        twins.readout_paged(pool, ids, torch.randn(1, 2, 3), torch.ones(1, 1, 2))


@pytest.mark.parametrize("B,W,C,bias,silu", [(1, 4, 96, True, True), (3, 2, 7, False, True),
                                             (2, 4, 33, False, False), (2, 1, 5, True, True)],
                         ids=["mamba-like", "w2-odd", "no-act", "w1-no-tail"])
def test_conv_step_matches_twin(B, W, C, bias, silu):
    g = torch.Generator().manual_seed(C)
    big = torch.randn(B + 2, W - 1, C, generator=g)
    tail = big[1:1 + B]  # a view of a slot pool
    x = torch.randn(B, C, generator=g)
    w = torch.randn(C, W, generator=g)
    bb = torch.randn(C, generator=g) if bias else None
    tail_ref = tail.clone()
    want = twins.conv_step_(tail_ref, x, w, bb, silu)
    got = cpu.conv_step_(tail, x, w, bb, silu)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(tail, tail_ref)


@pytest.mark.parametrize("R,D,group,wlen,gate", [
    (1, 256, 256, "full", None), (3, 96, 32, "group", None), (2, 48, 16, "full", "before"),
    (1, 64, 64, None, "after")], ids=["plain", "per-head", "mamba-gated", "gate-after"])
def test_rms_norm_matches_twin(R, D, group, wlen, gate):
    g = torch.Generator().manual_seed(D + R)
    x = torch.randn(R, D + 5, generator=g)[:, :D]  # rows with a stride (a slice of a wider out)
    w = {"full": torch.randn(D, generator=g), "group": torch.randn(group, generator=g),
         None: None}[wlen]
    z = torch.randn(R, D, generator=g) if gate else None
    nbg = gate == "after"
    got = cpu.rms_norm(x, w, 1e-5, group, z, nbg)
    assert rel_err(got, twins.rms_norm(x, w, 1e-5, group, z, nbg)) < 1e-5



@pytest.mark.parametrize("R,H", [(1, 1), (5, 37), (64, 688)], ids=["one", "odd", "mlp"])
def test_silu_mul_matches_twin(R, H):
    # the halves of a stacked projection (strided rows), values spanning the SiLU's range
    # (large negative ones give -0, large positive ones themselves), a NaN passed through
    g = torch.Generator().manual_seed(R + H)
    gu = torch.randn(R, 2 * H, generator=g) * 20.0
    gu[0, 0] = float("nan")
    gate, up = gu[:, :H], gu[:, H:]
    got = cpu.silu_mul(gate, up)
    assert got.is_contiguous() and got.shape == (R, H)
    want = twins.silu_mul(gate, up)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, equal_nan=True)
    x = torch.tensor([-200.0, -90.0, -20.0, -1e-3, 0.0, 1e-3, 3.0, 20.0, 90.0, 200.0] * 2)
    torch.testing.assert_close(cpu.silu_mul(x[None], torch.ones(1, 20)), F.silu(x)[None],
                               rtol=1e-6, atol=1e-30)
    with pytest.raises(RuntimeError, match="silu_mul"):
        cpu.ops().silu_mul(gate, up[:, :-1])


@pytest.mark.parametrize("R,D,group", [(1, 4, 4), (7, 96, 32), (33, 512, 64)],
                         ids=["one", "odd", "qk"])
def test_l2norm_matches_twin(R, D, group):
    # in place on a strided view of rows (q and k inside a qkv buffer): the columns past D
    # untouched, a zero group stays zero (the 1e-12 floor)
    g = torch.Generator().manual_seed(R * D)
    buf = torch.randn(R, D + group, generator=g)
    buf[0, :group] = 0.0
    keep = buf[:, D:].clone()
    want = twins.l2norm_(buf[:, :D].clone(), group)
    got = cpu.l2norm_(buf[:, :D], group)
    assert got.data_ptr() == buf.data_ptr()
    assert rel_err(got, want) < 1e-6
    torch.testing.assert_close(got, F.normalize(want.view(R, -1, group), dim=-1).view(R, D))
    assert torch.equal(buf[:, D:], keep) and bool((buf[0, :group] == 0).all())
    with pytest.raises(RuntimeError, match="group"):
        cpu.ops().l2norm_(buf[:, :D], group + 1)

def test_mc_scores_matches_twin():
    g = torch.Generator().manual_seed(3)
    B, H, K, N, NB = 3, 4, 16, 5, 12
    seg = torch.randn(B + 1, H, K, generator=g)[1:]  # a view of a slot pool
    k, u = torch.randn(B, H, K, generator=g), torch.randn(B, H, K, generator=g)
    seg_len = torch.tensor([0, 7, 63])
    ksum = torch.randn(NB, H, K, generator=g)
    table = torch.randint(0, NB, (B, N), generator=g)
    table[0, 2:] = -1  # a row with fewer blocks
    seg_ref = seg.clone()
    want = twins.mc_scores_(seg_ref, k, u, seg_len, ksum, table, 64)
    got = cpu.mc_scores_(seg, k, u, seg_len, ksum, table, 64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert rel_err(got[fin], want[fin]) < 1e-5 and rel_err(seg, seg_ref) < 1e-6
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu.mc_scores_(seg, k, u, seg_len, ksum, torch.full((B, N), NB), 64)


@pytest.mark.parametrize("n", [0, 1, 6], ids=["no-blocks", "one-block", "six-blocks"])
def test_mc_step_readout_matches_twin(n):
    g = torch.Generator().manual_seed(n)
    B, H, K, V = 2, 3, 8, 12
    S = torch.randn(B, H, K, V, generator=g)
    q, k = torch.randn(B, H, K, generator=g), torch.randn(B, H, K, generator=g)
    v = torch.randn(B, H, V, generator=g)
    log_a, b = -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)
    w_on = torch.rand(B, H, generator=g)
    pool = torch.randn(9, H, K, V, generator=g)
    ids = torch.randint(0, 9, (B, n, H), generator=g)
    w_c = torch.rand(B, n, H, generator=g)
    S_ref = S.clone()
    want = twins.mc_step_readout_(S_ref, q, k, v, log_a, b, w_on, pool, ids, w_c)
    got = cpu.mc_step_readout_(S, q, k, v, log_a, b, w_on, pool, ids, w_c)
    assert rel_err(got, want) < 1e-5 and rel_err(S, S_ref) < 1e-6


@pytest.mark.parametrize("shape,dtype", [
    ((3, 5), torch.float32), ((2100, 4, 64, 64), torch.float32), ((1 << 22,), torch.float64)],
    ids=["small-plain", "pool-hugepage", "float64"])
def test_zeros_like_torch_zeros(shape, dtype):
    t = cpu.zeros(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    t.view(-1)[-1] = 1.0  # the whole extent is writable, and freed with the tensor
    assert float(t.sum()) == 1.0
    del t
    direct = cpu.ops().zeros_hugepage([7, 3], torch.float32)
    assert direct.shape == (7, 3) and not direct.any()


@pytest.mark.parametrize("B,T,H,K,V,gated", [(1, 1, 1, 4, 4, True), (2, 7, 3, 5, 6, True),
                                              (1, 33, 24, 128, 64, True), (3, 9, 2, 8, 8, False)],
                         ids=["one", "odd", "mamba2-130m-heads", "ungated"])
def test_linear_scan_matches_twin(B, T, H, K, V, gated):
    # the token-by-token span against the per-token twin on fresh random inputs; q and k as
    # strided views (head-major storage), the initial state a row range of a pool, which
    # the scan must not modify
    g = torch.Generator().manual_seed(B * 100 + T * 10 + H)
    q = torch.randn(B, H, T, K, generator=g).transpose(1, 2)
    k = torch.randn(B, H, T, K, generator=g).transpose(1, 2) * 0.3
    v = torch.randn(B, T, H, V, generator=g)
    log_a = -torch.rand(B, T, H, generator=g) if gated else None
    b = torch.rand(B, T, H, generator=g) if gated else None
    pool = torch.randn(B + 2, H, K, V, generator=g)
    s0 = pool[1:B + 1]
    keep = pool.clone()
    o, s, ends = cpu.ops().linear_scan(q, k, v, log_a, b, s0, 0, False)
    o_ref, s_ref = twins.linear_scan(q, k, v, log_a, b, s0)
    assert ends.shape == (B, 0, H, K, V)
    assert torch.equal(pool, keep)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    o2, s2 = cpu.linear_scan(q, k, v, log_a, b, s0)
    assert torch.equal(o2, o) and torch.equal(s2, s)
    with pytest.raises(RuntimeError, match="q, k"):
        cpu.ops().linear_scan(q, k[:, :, :, :-1], v, log_a, b, s0, 0, False)


@pytest.mark.parametrize("B,T,H,K,V,chunk", [(1, 1, 1, 4, 4, 1), (2, 23, 3, 5, 6, 8),
                                              (1, 64, 4, 64, 64, 16), (3, 9, 2, 8, 8, 9)],
                         ids=["one", "odd-tail", "whole-chunks", "one-chunk"])
@pytest.mark.parametrize("restart", [False, True], ids=["carried", "restart"])
def test_linear_scan_ends_matches_twins(B, T, H, K, V, chunk, restart):
    # the span's state at every chunk end (Memory Caching's segment ends) against the
    # per-token twin and against the chunked torch form that GPUs and the twin-free path use
    from mcserve.kernels.gla import _chunked

    g = torch.Generator().manual_seed(B * 1000 + T * 10 + H + restart)
    q = torch.randn(B, H, T, K, generator=g).transpose(1, 2)
    k = torch.randn(B, T, H, K, generator=g) * 0.3
    v = torch.randn(B, T, H, V, generator=g)
    log_a = -torch.rand(B, T, H, generator=g)
    b = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g)
    keep = s0.clone()
    o, ends = cpu.linear_scan_ends(q, k, v, log_a, b, s0, chunk, restart)
    o_ref, ends_ref = twins.linear_scan_ends(q, k, v, log_a, b, s0, chunk, restart)
    o_ch, _, ends_ch = _chunked(q, k, v, log_a, b, s0, chunk, restart=restart, ends=True)
    assert torch.equal(s0, keep)
    assert ends.shape == ends_ref.shape == (B, -(-T // chunk), H, K, V)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ends, ends_ref) < 1e-5
    assert rel_err(o, o_ch) < 1e-4 and rel_err(ends, ends_ch) < 1e-4
    o_plain, s_plain = cpu.linear_scan(q, k, v, log_a, b, s0)
    if not restart:  # the same arithmetic as the scan without ends
        assert torch.equal(o, o_plain) and torch.equal(ends[:, -1], s_plain)
    with pytest.raises(ValueError, match="chunk"):
        cpu.linear_scan_ends(q, k, v, log_a, b, s0, 0, restart)


@pytest.mark.parametrize("B,V,W,rows", [(1, 1, 1, [0]), (7, 101, 4, [6, 0, 3]),
                                         (16, 4096, 128, list(range(16))), (3, 1000, 30, [1])],
                         ids=["one", "odd", "full", "short-words"])
def test_mask_logits_matches_twin(B, V, W, rows):
    # the grammar bitmask applied in place: fresh random words with all-set and all-clear ones,
    # rows in any order, a vocabulary past the words' 32 W tokens; NaN logits stay where allowed
    g = torch.Generator().manual_seed(B * V + W)
    logits = torch.randn(B, V, generator=g)
    logits[0, 0] = float("nan")
    bm = torch.randint(-2**31, 2**31 - 1, (len(rows), W), generator=g, dtype=torch.int64)
    bm = bm.to(torch.int32)
    bm[0, 0] = -1
    bm[-1, -1] = 0
    r = torch.tensor(rows)
    got = logits.clone()
    assert cpu.ops().mask_logits_(got, r, bm) is not None
    want = twins.mask_logits_(logits.clone(), r, bm)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    untouched = [i for i in range(B) if i not in rows]
    assert torch.equal(got[untouched].nan_to_num(), logits[untouched].nan_to_num())
    assert torch.equal(cpu.mask_logits_(logits.clone(), r, bm).nan_to_num(), got.nan_to_num())
    with pytest.raises(RuntimeError, match="outside the batch"):
        cpu.ops().mask_logits_(logits.clone(), torch.full_like(r, B), bm)
    with pytest.raises(RuntimeError, match="int32"):
        cpu.ops().mask_logits_(logits.clone(), r, bm.long())
