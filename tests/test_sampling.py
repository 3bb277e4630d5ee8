"""Tests for ``mcserve.engine.sampling``: SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import math

import pytest
import torch

from mcserve.engine.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    _apply_top_k_top_p,
    make_generator,
    prompt_logprobs,
)
from mcserve.errors import InvalidRequestError

V = 64
sampler = Sampler()


def random_logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def sample(logits, params, gens=None, outs=None, **kw):
    b = logits.shape[0]
    if isinstance(params, SamplingParams):
        params = [params] * b
    gens = gens if gens is not None else [None] * b
    outs = outs if outs is not None else [[] for _ in range(b)]
    return sampler(logits, params, gens, outs, **kw)


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def draw_counts(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> list[int]:
    """How often each token is drawn over n single-row draws (one seeded generator)."""
    gen = make_generator(1234)
    counts = [0] * logits.shape[1]
    for _ in range(n):
        counts[sample(logits, params, [gen]).token_ids[0]] += 1
    return counts


# --- SamplingParams --------------------------------------------------------------------------


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.ignore_eos and not p.include_stop_str_in_output and p.skip_special_tokens
    assert not p.greedy


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 0}, {"n": 1.5}, {"n": True},
        {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": "16"},
        {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
        {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -1},
        {"top_k": -2}, {"top_k": 2.0},
        {"min_p": -0.01}, {"min_p": 1.5},
        {"seed": 1.5}, {"seed": "7"},
        {"stop": 3}, {"stop": ["ok", 4]}, {"stop": [""]},
        {"stop_token_ids": [-1]}, {"stop_token_ids": "2"},
        {"ignore_eos": 1},
        {"presence_penalty": 2.5}, {"presence_penalty": -2.01},
        {"frequency_penalty": 3}, {"frequency_penalty": -2.5},
        {"repetition_penalty": 0}, {"repetition_penalty": -1.0},
        {"logprobs": -1}, {"logprobs": MAX_LOGPROBS + 1},
        {"prompt_logprobs": -1}, {"prompt_logprobs": 21},
        {"include_stop_str_in_output": "yes"}, {"skip_special_tokens": None},
    ],
    ids=lambda kw: next(iter(kw)) + "=" + repr(next(iter(kw.values()))),
)
def test_validation_names_the_argument(kwargs: dict) -> None:
    name = next(iter(kwargs))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(name + " ")
    assert err.value.param == name


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1}, {"top_k": 0}, {"top_p": 1.0}, {"min_p": 1.0}, {"max_tokens": None},
        {"presence_penalty": -2}, {"frequency_penalty": 2}, {"repetition_penalty": 5.0},
        {"logprobs": 0}, {"logprobs": MAX_LOGPROBS}, {"prompt_logprobs": 0}, {"seed": -5},
        {"temperature": 0},
    ],
)
def test_valid_edge_values(kwargs: dict) -> None:
    SamplingParams(**kwargs)


# --- greedy and truncation -------------------------------------------------------------------


def test_top_k_1_equals_greedy_equals_temperature_0() -> None:
    logits = random_logits(16)
    expected = logits.argmax(dim=-1).tolist()
    gens = [make_generator(i) for i in range(16)]
    assert sample(logits, SamplingParams(temperature=0)).token_ids == expected
    assert sample(logits, SamplingParams(top_k=1), gens).token_ids == expected
    assert sample(logits, SamplingParams(top_k=1, temperature=5.0)).token_ids == expected


def test_top_k_1_breaks_ties_like_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert sample(logits, SamplingParams(top_k=1)).token_ids == [1]
    assert sample(logits, SamplingParams(temperature=0)).token_ids == [1]


def test_tiny_top_p_is_argmax() -> None:
    logits = random_logits(16, seed=1)
    out = sample(logits, SamplingParams(top_p=1e-6, temperature=2.0))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_the_k_best() -> None:
    counts = draw_counts(probs_logits([0.1, 0.4, 0.3, 0.2]), SamplingParams(top_k=2))
    assert counts[0] == 0 and counts[3] == 0 and counts[1] > 0 and counts[2] > 0


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # sorted: 0.5 (token 2), 0.3 (token 0), 0.15, 0.05 -> p=0.75 needs tokens 2 and 0
    counts = draw_counts(probs_logits([0.3, 0.15, 0.5, 0.05]), SamplingParams(top_p=0.75))
    assert counts[1] == 0 and counts[3] == 0 and counts[0] > 0 and counts[2] > 0


def reference_kept(row: list[float], k: int, p: float) -> set[int]:
    """Plain per-row top-k then top-p: the token ids that survive."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if 0 < k < len(row):
        order = order[:k]
    z = [math.exp(row[i]) for i in order]
    probs = [x / sum(z) for x in z]
    kept, mass = set(), 0.0
    for i, pr in zip(order, probs):
        if p < 1 and mass >= p:
            break
        kept.add(i)
        mass += pr
    return kept


@pytest.mark.parametrize(
    "settings",
    [
        [(3, 1.0), (7, 1.0), (0, 1.0)],  # top-k only, mixed with an untouched row
        [(5, 1.0), (2, 1.0)],  # every row has a top-k: the topk() path
        [(0, 0.5), (4, 0.9), (-1, 1.0), (10, 0.3)],  # top-p forces the full sort
        [(6, 0.6), (3, 0.99)],
    ],
)
def test_top_k_top_p_mask_matches_a_reference(settings: list[tuple[int, float]]) -> None:
    logits = random_logits(len(settings), v=40, seed=11)
    masked = _apply_top_k_top_p(logits, [k for k, _ in settings], [p for _, p in settings])
    for i, (k, p) in enumerate(settings):
        kept = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert kept == reference_kept(logits[i].tolist(), k, p), (k, p)
        assert torch.equal(masked[i][list(kept)], logits[i][list(kept)])


def test_min_p_drops_tokens_below_the_threshold() -> None:
    # max prob 0.5, min_p 0.5 -> threshold 0.25: tokens with 0.3 and 0.5 stay
    logits = probs_logits([0.15, 0.3, 0.5, 0.05])
    counts = draw_counts(logits, SamplingParams(min_p=0.5))
    assert counts[0] == 0 and counts[3] == 0 and counts[1] > 0 and counts[2] > 0
    # without min_p every token shows up
    assert all(c > 0 for c in draw_counts(logits, SamplingParams(), n=600))


def test_sampling_follows_the_distribution() -> None:
    logits = probs_logits([0.7, 0.2, 0.1])
    counts = draw_counts(logits, SamplingParams(), n=2000)
    assert abs(counts[0] / 2000 - 0.7) < 0.05 and abs(counts[2] / 2000 - 0.1) < 0.04


def test_low_temperature_concentrates() -> None:
    counts = draw_counts(probs_logits([0.4, 0.35, 0.25]), SamplingParams(temperature=0.01))
    assert counts[0] == sum(counts)


# --- seeds -----------------------------------------------------------------------------------


def run_seeded(seeds: list[int | None], steps: int = 15, temperature: float = 1.0):
    logits = random_logits(len(seeds), seed=7) / 3  # fairly flat: draws vary
    params = [SamplingParams(seed=s, temperature=temperature) for s in seeds]
    gens = [make_generator(s) for s in seeds]
    return [sample(logits, params, gens).token_ids for _ in range(steps)]


def test_seeded_sampling_reproduces() -> None:
    assert run_seeded([1, 2, 3]) == run_seeded([1, 2, 3])


def test_different_seeds_differ() -> None:
    a = [row[0] for row in run_seeded([1])]
    b = [row[0] for row in run_seeded([2])]
    assert a != b


def test_seeded_row_does_not_depend_on_the_batch() -> None:
    logits = random_logits(1, seed=3) / 3
    alone_gen = make_generator(42)
    alone = [sample(logits, SamplingParams(), [alone_gen]).token_ids[0] for _ in range(20)]

    others = random_logits(3, seed=4)
    batch = torch.cat([others[:1], logits, others[1:]])
    params = [SamplingParams(top_k=5), SamplingParams(), SamplingParams(temperature=0),
              SamplingParams(min_p=0.1)]
    gens = [None, make_generator(42), None, make_generator(9)]
    in_batch = [sample(batch, params, gens).token_ids[1] for _ in range(20)]
    assert alone == in_batch


def test_make_generator() -> None:
    assert make_generator(None) is None
    a = torch.rand(4, generator=make_generator(5, index=0))
    b = torch.rand(4, generator=make_generator(5, index=1))
    c = torch.rand(4, generator=make_generator(5))
    assert torch.equal(a, c) and not torch.equal(a, b)


# --- penalties -------------------------------------------------------------------------------


GREEDY = {"temperature": 0.0}


def greedy_pick(logits: list[float], output: list[int], prompt: list[int] | None = None,
                **penalties: float) -> int:
    out = sample(torch.tensor([logits]), SamplingParams(**GREEDY, **penalties), outs=[output],
                 prompt_token_ids=None if prompt is None else [prompt])
    return out.token_ids[0]


def test_presence_penalty() -> None:
    logits = [2.0, 1.9, 0.0]
    assert greedy_pick(logits, [0]) == 0
    assert greedy_pick(logits, [0], presence_penalty=0.5) == 1
    assert greedy_pick(logits, [2, 2], presence_penalty=0.5) == 0  # only seen tokens change
    assert greedy_pick(logits, [1], presence_penalty=-0.5) == 1  # negative: encourage repeats


def test_frequency_penalty_counts_occurrences() -> None:
    logits = [2.0, 1.9, 0.0]
    assert greedy_pick(logits, [0], frequency_penalty=0.05) == 0  # 1.95 > 1.9
    assert greedy_pick(logits, [0, 0, 0], frequency_penalty=0.05) == 1  # 1.85 < 1.9


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    assert greedy_pick([2.0, 1.9], [0], repetition_penalty=1.2) == 1  # 2 / 1.2 = 1.67
    assert greedy_pick([2.0, 1.9], [0, 0, 0], repetition_penalty=1.01) == 0  # once, not per count
    assert greedy_pick([-1.0, -1.1], [0], repetition_penalty=1.2) == 1  # -1.2 < -1.1
    assert greedy_pick([1.0, 1.2], [1], repetition_penalty=0.5) == 1  # < 1 rewards repeats


def test_repetition_penalty_covers_the_prompt_when_given() -> None:
    assert greedy_pick([2.0, 1.9], [], prompt=None, repetition_penalty=1.2) == 0
    assert greedy_pick([2.0, 1.9], [], prompt=[0], repetition_penalty=1.2) == 1
    # presence / frequency only count generated tokens
    assert greedy_pick([2.0, 1.9], [], prompt=[0], presence_penalty=1.0) == 0


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    out = sample(logits, params, outs=[[0], [0]])
    assert out.token_ids == [1, 0]


def test_input_logits_are_not_modified() -> None:
    logits = random_logits(3)
    before = logits.clone()
    sample(logits, SamplingParams(presence_penalty=1.0, repetition_penalty=1.5, top_p=0.5,
                                  temperature=0.7, min_p=0.1),
           outs=[[1, 2], [3], []])
    assert torch.equal(logits, before)


# --- logprobs --------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = random_logits(4, seed=5)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.3, top_k=5, logprobs=3, presence_penalty=1.5),
        SamplingParams(temperature=0, logprobs=0, repetition_penalty=1.7),
        SamplingParams(top_p=0.5, logprobs=MAX_LOGPROBS),
        SamplingParams(min_p=0.2),
    ]
    gens = [make_generator(i) for i in range(4)]
    out = sample(logits, params, gens, outs=[[1, 2, 3], [4], [], []])
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-6)

    top3 = out.top_logprobs[0]
    best3 = raw[0].topk(3).indices.tolist()
    assert list(top3)[:3] == best3
    assert out.token_ids[0] in top3
    for tok, lp in top3.items():
        assert lp.logprob == pytest.approx(raw[0, tok].item(), abs=1e-6)
        assert lp.rank == 1 + int((raw[0] > raw[0, tok]).sum())
        assert lp.decoded_token is None  # the sampler has no tokenizer: the engine decodes

    assert list(out.top_logprobs[1]) == [out.token_ids[1]]
    assert out.top_logprobs[1][out.token_ids[1]].logprob == pytest.approx(out.logprobs[1])
    assert len(out.top_logprobs[2]) in (MAX_LOGPROBS, MAX_LOGPROBS + 1)
    assert out.token_ids[2] in out.top_logprobs[2]
    assert out.top_logprobs[3] is None


def test_sampled_token_outside_top_n_is_added_last() -> None:
    logits = torch.tensor([[2.0, 1.5, 0.5, -1.0]])
    out = sample(logits, SamplingParams(temperature=0, logprobs=1, presence_penalty=2.0),
                 outs=[[0, 1]])  # penalties push the pick down to token 2
    assert out.token_ids == [2]
    assert list(out.top_logprobs[0]) == [0, 2]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[2].item())
    assert [lp.rank for lp in out.top_logprobs[0].values()] == [1, 3]


def test_rank_counts_strictly_larger_logprobs() -> None:
    # ties share a rank; the sampled token's rank is counted over the whole vocabulary
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 2.0]])
    out = sample(logits, SamplingParams(temperature=0, logprobs=3, repetition_penalty=100.0),
                 outs=[[1, 2, 4]])  # the penalty drives the pick to token 0
    assert out.token_ids == [0]
    assert {t: lp.rank for t, lp in out.top_logprobs[0].items()} == {1: 1, 2: 1, 4: 3, 0: 4}


def test_logprobs_larger_than_vocab() -> None:
    out = sample(torch.tensor([[0.0, 1.0, 2.0]]), SamplingParams(logprobs=5))
    assert sorted(out.top_logprobs[0]) == [0, 1, 2]
    assert math.isclose(sum(math.exp(v.logprob) for v in out.top_logprobs[0].values()), 1,
                        rel_tol=1e-5)
    assert [v.rank for v in out.top_logprobs[0].values()] == [1, 2, 3]


def test_prompt_logprobs() -> None:
    logits = random_logits(5, seed=6)
    ids = [3, 10, 7, 7, 1]
    raw = torch.log_softmax(logits, dim=-1)
    res = prompt_logprobs(logits, ids, 2)
    assert len(res) == 5 and res[0] is None
    for i in range(1, 5):
        entry = res[i]
        assert entry[ids[i]].logprob == pytest.approx(raw[i - 1, ids[i]].item(), abs=1e-6)
        assert entry[ids[i]].rank == 1 + int((raw[i - 1] > raw[i - 1, ids[i]]).sum())
        assert list(entry)[:2] == raw[i - 1].topk(2).indices.tolist()
        assert [lp.rank for lp in list(entry.values())[:2]] == [1, 2]
    bare = prompt_logprobs(logits[:4], torch.tensor(ids), 0)[1:]
    assert [list(e) for e in bare] == [[ids[i]] for i in range(1, 5)]
    for i, e in enumerate(bare, start=1):
        assert e[ids[i]].logprob == pytest.approx(raw[i - 1, ids[i]].item(), abs=1e-6)
    assert Sampler.prompt_logprobs(logits[:1], [4], 3) == [None]
    with pytest.raises(ValueError):
        prompt_logprobs(logits, ids[:2], 1)


def test_shape_and_length_checks() -> None:
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(3), [SamplingParams()], [None], [[]])
    with pytest.raises(ValueError, match="params"):
        sampler(torch.zeros(2, 4), [SamplingParams()], [None, None], [[], []])
