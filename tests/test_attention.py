"""The attention ops of hybrid models (mcserve/kernels/attention.py) against their naive twins
on fresh random inputs: odd lengths, several heads, grouped-query heads, a cached prefix; and
the paged pool's write/gather against a contiguous copy."""

from __future__ import annotations

import pytest
import torch

from mcserve.kernels import attention as ops
from mcserve.kernels import cpu as cpu_ops


@pytest.mark.parametrize("H,Hkv", [(1, 1), (4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("T,S", [(1, 1), (7, 7), (1, 13), (5, 21), (33, 40)])
def test_attend_matches_naive(H, Hkv, T, S):
    g = torch.Generator().manual_seed(H * 100 + T * 10 + S)
    D = 16
    q = torch.randn(2, T, H, D, generator=g)
    k = torch.randn(2, S, Hkv, D, generator=g)
    v = torch.randn(2, S, Hkv, D, generator=g)
    torch.testing.assert_close(ops.attend(q, k, v, D ** -0.5), ops.naive_attend(q, k, v, D ** -0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2)])
def test_attend_decode_matches_naive(H, Hkv):
    g = torch.Generator().manual_seed(7)
    D, S = 8, 37
    lengths = torch.tensor([1, 37, 20, 5])
    q = torch.randn(4, 1, H, D, generator=g)
    k = torch.randn(4, S, Hkv, D, generator=g)
    v = torch.randn(4, S, Hkv, D, generator=g)
    k[0, 1:] = float("nan")  # padding past a row's length is never read
    v[0, 1:] = float("nan")
    want = ops.naive_attend_decode(q, k, v, lengths, 0.3)
    torch.testing.assert_close(ops.attend_decode(q, k, v, lengths, 0.3), want,
                               atol=1e-5, rtol=1e-5)
    # on scratch copies, cleared in place
    torch.testing.assert_close(ops.attend_decode(q, k.clone(), v.clone(), lengths, 0.3,
                                                 owned=True), want, atol=1e-5, rtol=1e-5)


def test_pages_round_trip_and_batch_gather():
    g = torch.Generator().manual_seed(3)
    bs, Hkv, D = 4, 2, 3
    pool = torch.full((9, bs, Hkv, D), float("nan"))
    tables = [[5, 2, 7], [0, 8]]
    rows = [torch.randn(11, Hkv, D, generator=g), torch.randn(6, Hkv, D, generator=g)]
    for table, x in zip(tables, rows):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(x))])
        ops.write_pages(pool, slots, x)
    for table, x in zip(tables, rows):
        torch.testing.assert_close(ops.gather_pages(pool, torch.tensor(table), len(x)), x)
    padded = torch.tensor([[5, 2, 7], [0, 8, -1]])
    got = ops.gather_pages_batch(pool, padded)
    assert got.shape == (2, 12, Hkv, D)
    torch.testing.assert_close(got[0, :11], rows[0])
    torch.testing.assert_close(got[1, :6], rows[1])


@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 16), (6, 2, 8), (8, 1, 64)])
def test_paged_decode_matches_naive(H, Hkv, D):
    """The paged decode (C++ in place where it runs, else gathered) against its naive twin:
    ragged lengths over shared and scattered blocks, a partial last block, NaN in every row
    no length reaches."""
    g = torch.Generator().manual_seed(H + D)
    bs, NB = 4, 12
    k_pool = torch.randn(NB, bs, Hkv, D, generator=g)
    v_pool = torch.randn(NB, bs, Hkv, D, generator=g)
    tables = torch.tensor([[3, 7, 1, -1], [0, -1, -1, -1], [5, 2, 9, 11], [3, 7, 8, -1]])
    lengths = torch.tensor([10, 1, 16, 9])
    used = {(int(tables[b, t // bs]), t % bs) for b in range(4) for t in range(int(lengths[b]))}
    for blk in range(NB):
        for row in range(bs):
            if (blk, row) not in used:
                k_pool[blk, row] = float("nan")
                v_pool[blk, row] = float("nan")
    q = torch.randn(4, 1, H, D, generator=g)
    want = ops.naive_paged_decode(q, k_pool, v_pool, tables, lengths, D ** -0.5)
    got = ops.paged_decode(q, k_pool, v_pool, tables, lengths, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with cpu_ops.twins_only():  # the gathered path (what runs where the C++ op does not)
        got = ops.paged_decode(q, k_pool, v_pool, tables, lengths, D ** -0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rotary_frequencies_follow_the_layer_device_and_stay_float32():
    # a decode step must not copy them from the host (a sync no CUDA graph can hold)
    from mcserve.models.attention import Attention, Rotary

    a = Attention(16, 2, 1, 8, 0, rotary=Rotary(8, 8, 1e4))
    a.to(device="meta")
    assert a.rotary.inv_freq.device.type == "meta"
    a.to(dtype=torch.bfloat16)  # no device: stays where it is, in float32
    assert a.rotary.inv_freq.device.type == "meta"
    assert a.rotary.inv_freq.dtype == torch.float32
    assert a.q_proj.weight.dtype == torch.bfloat16
