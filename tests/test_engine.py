"""Engine invariants: the same greedy output alone, batched, after preemption, and after a
prefix-cache hit; pools whole after every test."""

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.errors import InvalidRequestError
from mcserve.models.native import MCForCausalLM

PROMPT_LENS = [1, 3, 4, 5, 9, 16, 23, 40]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation of ``ids``: a prefill, then one forward per token
    from the returned state (no engine involved)."""
    logits, state = model(torch.tensor([ids], device=model.device), last_only=True)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits, state = model(torch.tensor([[out[-1]]], device=model.device), state)
    return out


def make_model(memory="linear", variant="grm", mode="checkpoint", seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=8,
                      memory=memory, mc_variant=variant, mc_mode=mode, segment_len=4,
                      mc_top_k=1, inner_chunk=2, memory_expansion=2)
    return MCForCausalLM(cfg).double()


ENGINES = []


def make_engine(model, **kw):
    args = dict(max_num_seqs=8, num_state_blocks=128, max_num_batched_tokens=64,
                dtype="float64", max_model_len=128)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=model)
    ENGINES.append(eng)
    return eng


@pytest.fixture(autouse=True)
def pools_whole_after():
    ENGINES.clear()
    yield
    for eng in ENGINES:
        assert not eng.has_unfinished_requests()
        assert eng.cache.is_whole(), "a block or slot leaked"
        assert not eng.runner.states, "a private (loglinear) state leaked"


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run(eng, ps, params=GREEDY):
    return [o.outputs[0].token_ids for o in LLM(engine=eng).generate(ps, params)]


COMBOS = [
    pytest.param("linear", "grm", "checkpoint", id="linear-grm"),
    pytest.param("linear", "ssc", "independent", id="linear-ssc-indep"),
    pytest.param("linear", "post", "independent", id="linear-post-indep"),
    pytest.param("swla", "residual", "checkpoint", id="swla-residual"),
    pytest.param("dla", "soup", "checkpoint", id="dla-soup"),
    pytest.param("titans", "grm", "independent", id="titans-grm-indep"),
    pytest.param("linear", "none", "checkpoint", id="linear-none"),
    pytest.param("swla", "loglinear", "checkpoint", id="swla-loglinear"),
]


@pytest.mark.parametrize("memory,variant,mode", COMBOS)
def test_batched_prefill_same_as_alone(monkeypatch, memory, variant, mode):
    # prompts arriving together prefill in one variable-length call (ModelRunner.prefill_varlen;
    # those of equal length mix as one batch) through segment pushes: same greedy tokens as
    # generating each alone; a prefix-cache hit on the second round resumes every row from a
    # cached block and packs them again
    model = make_model(memory, variant, mode)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in [10] * 4 + [7] * 3]
    alone = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    eng = make_engine(model)
    sizes = []
    real = eng.runner.prefill_varlen
    monkeypatch.setattr(eng.runner, "prefill_varlen",
                        lambda items: sizes.append(len(items)) or real(items))
    assert run(eng, ps) == alone
    if variant == "loglinear":  # private per-sequence states: never batched
        assert not sizes
        return
    assert sizes and max(sizes) >= 3
    sizes.clear()
    assert run(eng, ps) == alone
    assert max(sizes) >= 3


@pytest.mark.parametrize("memory,variant,mode", COMBOS)
def test_greedy_same_alone_batched_preempted_cached(memory, variant, mode):
    model = make_model(memory, variant, mode)
    ps = prompts()
    alone = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    # one engine, all prompts at once (ragged decode batch)
    eng = make_engine(model)
    assert run(eng, ps) == alone
    # second run: prompts' complete segments come from the prefix cache
    hits0 = eng.stats()["prefix_cache_hits"]
    assert run(eng, ps) == alone
    if variant not in ("none", "loglinear"):
        assert eng.stats()["prefix_cache_hits"] > hits0
    # a pool so small that sequences are preempted and recomputed
    small = make_engine(model, num_state_blocks=14, max_num_batched_tokens=16)
    assert run(small, ps) == alone
    if variant not in ("none", "loglinear"):
        assert small.stats()["num_preemptions"] > 0
    # the same without prefix caching (recompute from scratch)
    plain = make_engine(model, num_state_blocks=14, enable_prefix_caching=False)
    assert run(plain, ps) == alone
    # one sequence slot at a time
    serial = make_engine(model, max_num_seqs=1)
    assert run(serial, ps) == alone


@pytest.mark.parametrize("memory,variant,mode", [
    pytest.param("linear", "grm", "checkpoint", id="linear-grm"),
    pytest.param("linear", "post", "independent", id="linear-post-indep"),
    pytest.param("dla", "ssc", "checkpoint", id="dla-ssc"),
])
@pytest.mark.parametrize("prompt_len", [9, 40, 63])
def test_one_model_call_per_prefill_chunk(memory, variant, mode, prompt_len):
    """A prefill chunk crossing many segment boundaries (segments of 4 tokens: 2 to 15 of them
    here) is one model call, and the checkpoints it writes serve a later prefix hit exactly."""
    model = make_model(memory, variant, mode)
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[1]))
    g = torch.Generator().manual_seed(prompt_len)
    p = torch.randint(0, 256, (prompt_len,), generator=g).tolist()
    want = greedy(model, p, GREEDY.max_tokens)
    calls.clear()
    eng = make_engine(model, max_num_batched_tokens=64)
    assert run(eng, [p]) == [want]
    assert calls == [prompt_len], "prefill took more than one model call"
    # the blocks written by that one call are what a second request resumes from
    hits0 = eng.stats()["prefix_cache_hits"]
    calls.clear()
    assert run(eng, [p]) == [want]
    assert eng.stats()["prefix_cache_hits"] > hits0
    assert calls == [prompt_len - (prompt_len - 1) // 4 * 4]  # only the uncached tail


def test_chunked_prefill_aligned_and_budgeted():
    model = make_model()
    eng = make_engine(model, max_num_batched_tokens=8)
    p = prompts()[-1]
    eng.add_request("a", None, GREEDY, prompt_token_ids=p)
    seen = []
    while eng.has_unfinished_requests():
        before = eng.scheduler.running[0].num_computed_tokens if eng.scheduler.running else 0
        eng.step()
        if eng.scheduler.running:
            now = eng.scheduler.running[0].num_computed_tokens
            seen.append((before, now))
    prefill_steps = [(a, b) for a, b in seen if b < len(p)]
    assert prefill_steps and all(b - a <= 8 and b % 4 == 0 for a, b in prefill_steps)


def test_abort_frees_everything():
    model = make_model()
    eng = make_engine(model)
    for i, p in enumerate(prompts()):
        eng.add_request(str(i), None, SamplingParams(max_tokens=50, ignore_eos=True),
                        prompt_token_ids=p)
    eng.step()
    eng.step()
    assert eng.stats()["state_blocks_used"] > 0
    for i in range(len(PROMPT_LENS)):
        eng.abort_request(str(i))
    eng.abort_request("0")  # idempotent
    assert eng.cache.is_whole()


def test_exception_in_one_request_fails_only_it(monkeypatch):
    model = make_model()
    eng = make_engine(model)
    ps = prompts()
    want = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    original = eng._append

    def flaky(seq, tok, lp, top):
        if seq.request_id == "3" and len(seq.output_ids) == 4:
            raise RuntimeError("boom")
        return original(seq, tok, lp, top)

    monkeypatch.setattr(eng, "_append", flaky)
    for i, p in enumerate(ps):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["3"].outputs[0].finish_reason == "error" and "boom" in done["3"].error
    for i in range(len(ps)):
        if i != 3:
            assert done[str(i)].outputs[0].token_ids == want[i]


def test_sampling_seeded_topk1_logprobs():
    model = make_model()
    eng = make_engine(model)
    llm = LLM(engine=eng)
    ps = prompts()[:4]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    a = llm.generate(ps, seeded)
    b = llm.generate(ps, seeded)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    topk1 = SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True)
    assert run(eng, ps, topk1) == run(eng, ps, SamplingParams(max_tokens=8, temperature=0,
                                                                ignore_eos=True))
    for o in a:
        c = o.outputs[0]
        picked = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]
        assert sum(picked) == pytest.approx(c.cumulative_logprob, abs=1e-6)
        assert all(len(lp) >= 2 for lp in c.logprobs)


def test_n_completions_and_prompt_logprobs():
    model = make_model()
    eng = make_engine(model)
    p = prompts()[5]
    out = LLM(engine=eng).generate(
        [p], SamplingParams(n=3, max_tokens=5, seed=1, ignore_eos=True, prompt_logprobs=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    # prompt logprobs equal log_softmax of a plain forward
    with torch.no_grad():
        logits, _ = model(torch.tensor([p]))
    lp = torch.log_softmax(logits[0].float(), -1)
    for i in range(1, len(p)):
        got = out.prompt_logprobs[i][p[i]]
        assert got.logprob == pytest.approx(lp[i - 1, p[i]].item(), abs=1e-5)
        assert got.rank == 1 + int((lp[i - 1] > lp[i - 1, p[i]]).sum())
        assert got.decoded_token == eng.tokenizer.decode([p[i]], skip_special_tokens=False)


def test_logprob_objects():
    # CompletionOutput.logprobs holds Logprob(logprob, rank, decoded_token): the greedy pick is
    # the most likely token (rank 1), alternatives rank by their raw logprob, text decoded
    model = make_model()
    eng = make_engine(model)
    p = prompts()[4]
    out = LLM(engine=eng).generate(
        [p], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    c = out.outputs[0]
    ids = list(p)
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        lp = torch.log_softmax(logits[0, -1].float(), -1)
        assert list(entry)[:3] == lp.topk(3).indices.tolist()
        assert entry[tok].rank == 1
        for t, x in entry.items():
            assert x.logprob == pytest.approx(lp[t].item(), abs=1e-5)
            assert x.rank == 1 + int((lp > lp[t]).sum())
            assert x.decoded_token == eng.tokenizer.decode([t], skip_special_tokens=False)
        ids.append(tok)


def test_stop_string_split_across_tokens():
    model = make_model()
    eng = make_engine(model)
    p = prompts()[4]
    free = run(eng, [p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    text = eng.tokenizer.decode(free)
    # byte-level tokenizer: a 2-character stop string spans two tokens
    stop = text[3:5]
    out = LLM(engine=eng).generate([p], SamplingParams(max_tokens=12, temperature=0,
                                                       ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(n=0), "n"),
])
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name) as err:
        SamplingParams(**kwargs)
    assert err.value.param == name


def test_bad_requests():
    model = make_model()
    eng = make_engine(model, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        eng.add_request("long", None, GREEDY, prompt_token_ids=[1] * 40)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="max_model_len") as err:
        eng.add_request("long", None, SamplingParams(max_tokens=20), prompt_token_ids=[1] * 20)
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="empty") as err:
        eng.add_request("e", None, GREEDY, prompt_token_ids=[])
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="token ids") as err:
        eng.add_request("v", None, GREEDY, prompt_token_ids=[1, 999])
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="prompt must be a string") as err:
        eng.add_request("s", 5, GREEDY)
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="mc_top_k") as err:
        eng.add_request("o", None, GREEDY, prompt_token_ids=[1], mc_overrides={"mc_top_k": 2})
    assert err.value.param == "mc_top_k"  # grm: no per-request MC settings
    eng.add_request("dup", None, GREEDY, prompt_token_ids=[1, 2])
    with pytest.raises(InvalidRequestError, match="request_id"):
        eng.add_request("dup", None, GREEDY, prompt_token_ids=[1, 2])
    eng.abort_request("dup")
    with pytest.raises(ValueError, match="mc_variant"):
        EngineConfig(mc_variant="bogus")
    with pytest.raises(ValueError, match="num_state_blocks"):
        EngineConfig(num_state_blocks=0)
    with pytest.raises(ValueError, match="state_cache_mib"):
        EngineConfig(state_cache_mib=0)


def test_automatic_block_pool_size():
    from mcserve.engine.state_cache import StateCache

    # None: enough for every slot at max_model_len (128 // C=4 = 32 blocks each) ...
    grm = make_engine(make_model(), num_state_blocks=None, max_num_seqs=3)
    assert grm.cache.num_blocks == 3 * 32
    # ... capped by the memory budget (three quarters of it with prefix caching: the resume
    # points take the rest) ...
    per = StateCache.block_bytes(grm.model)
    assert per == grm.cache.bytes_per_block > 0
    mib = 1
    capped = make_engine(make_model(), num_state_blocks=None, max_num_seqs=3, max_model_len=4096,
                         state_cache_mib=mib)
    assert capped.cache.num_blocks == 3 * 2**20 // 4 // per
    assert capped.resume.budget_bytes == 2**20 - capped.cache.num_blocks * per
    whole = make_engine(make_model(), num_state_blocks=None, max_num_seqs=3, max_model_len=4096,
                        state_cache_mib=mib, enable_prefix_caching=False)
    assert whole.cache.num_blocks == 2**20 // per
    # ... and no pool at all when the variant caches nothing; it still generates
    none = make_engine(make_model(variant="none"), num_state_blocks=None)
    assert none.cache.num_blocks == 0
    assert all(len(t) == 10 for t in run(none, prompts()[:3]))
    # an explicit count is kept as given
    assert make_engine(make_model(), num_state_blocks=7).cache.num_blocks == 7


def test_pool_exhausted_allocation_returns_none():
    model = make_model()
    eng = make_engine(model, num_state_blocks=4)
    got = eng.cache.allocate(4)
    assert got is not None and eng.cache.allocate(1) is None
    eng.cache.free(got)


@pytest.mark.parametrize("memory,variant", [("linear", "grm"), ("dla", "residual")])
def test_swap_to_host_tier_gives_same_output(memory, variant):
    model = make_model(memory, variant)
    ps = prompts()
    alone = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    eng = make_engine(model, num_state_blocks=14, max_num_batched_tokens=16,
                      host_state_blocks=64, enable_prefix_caching=False)
    assert run(eng, ps) == alone
    st = eng.stats()
    assert st["num_swaps"] > 0 and st["host_bytes_moved"] > 0


@pytest.mark.parametrize("mode", ["checkpoint", "independent"])
def test_ssc_more_segments_than_device_pool(mode):
    # a 60-token prompt has 15 segments of 4; the device pool holds 6 blocks: the rest live on
    # the host tier, the router reads their key sums and fetches only what it selects
    model = make_model("linear", "ssc", mode)
    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 45, 7)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    full = make_engine(model, num_state_blocks=128)
    want = run(full, ps, params)
    assert want == [greedy(model, p, 12) for p in ps]
    small = make_engine(model, num_state_blocks=6, host_state_blocks=64,
                        max_num_batched_tokens=16)
    cache, per_fetch = small.cache, []
    real_fetch = cache.fetch

    def fetch(*a):
        b0, n0 = cache.bytes_moved, cache.num_fetched
        out = real_fetch(*a)
        per_fetch.append((cache.bytes_moved - b0, cache.num_fetched - n0))
        return out

    cache.fetch = fetch
    assert run(small, ps, params) == want
    st = small.stats()
    assert st["host_blocks_offloaded"] > 0 and st["host_blocks_fetched"] > 0
    # staging: one row per (slot, pick), each head staging into its own slice of a row; a fetch
    # copies one head of one layer's readout state (K x V float64), not a whole block
    cfg = model.config
    assert cache.num_staging == 8 * cfg.mc_top_k and cache.host_base == 6 + 8 * cfg.mc_top_k
    assert sum(n for _, n in per_fetch) > 0
    assert all(b == n * cfg.head_dim * cfg.head_dim * 8 for b, n in per_fetch)


def test_sampler_failure_in_one_row_fails_only_that_request():
    # a repetition penalty so small that the row's probabilities overflow: only that request
    # fails, the rest of the batch samples normally
    model = make_model()
    eng = make_engine(model)
    ps = prompts()[:3]
    want = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    bad = SamplingParams(max_tokens=10, temperature=1.0, repetition_penalty=5e-324,
                         ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    eng.add_request("bad", None, bad, prompt_token_ids=ps[0] + ps[0])
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done["bad"].outputs[0].finish_reason == "error"
    assert [done[str(i)].outputs[0].token_ids for i in range(3)] == want


def test_per_request_ssc_top_k():
    # mc_top_k per request equals a model configured with that top_k, in the same batch as
    # requests using the model's own; other overrides are refused by name
    model = make_model("linear", "ssc")  # mc_top_k = 1
    wide = MCForCausalLM(model.config.replace(mc_top_k=3)).double()
    wide.load_state_dict(model.state_dict())
    ps = prompts()
    eng = make_engine(model)
    for i, p in enumerate(ps):
        eng.add_request(f"k3-{i}", None, GREEDY, prompt_token_ids=p, mc_overrides={"mc_top_k": 3})
        eng.add_request(f"k1-{i}", None, GREEDY, prompt_token_ids=p)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    for i, p in enumerate(ps):
        assert done[f"k3-{i}"] == greedy(wide, p, GREEDY.max_tokens)
        assert done[f"k1-{i}"] == greedy(model, p, GREEDY.max_tokens)
    with pytest.raises(InvalidRequestError, match="mc_top_k") as err:
        eng.add_request("x", None, GREEDY, prompt_token_ids=[1], mc_overrides={"mc_top_k": 0})
    assert err.value.param == "mc_top_k"
    with pytest.raises(InvalidRequestError, match="segment_len") as err:
        eng.add_request("y", None, GREEDY, prompt_token_ids=[1], mc_overrides={"segment_len": 8})
    assert err.value.param == "segment_len"


def _run_all(eng):
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_non_finite_logits_fail_only_that_request(monkeypatch, temperature):
    # a state that overflowed mid-decode (NaN in one row of the batch): that request fails
    # with a message naming the cause instead of decoding token 0 forever (greedy) or failing
    # with torch's multinomial message (sampled); the rest of the batch is untouched
    model = make_model()
    eng = make_engine(model)
    ps = prompts()[:4]
    want = [greedy(model, p, GREEDY.max_tokens) for p in ps]
    original = eng.runner.decode

    def overflowing(items):
        logits = original(items)
        for r, item in enumerate(items):
            if item.seq.request_id == "bad" and len(item.seq.output_ids) == 3:
                logits[r, 7] = float("nan") if temperature == 0 else float("inf")
        return logits

    monkeypatch.setattr(eng.runner, "decode", overflowing)
    for i, p in enumerate(ps):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    bad = SamplingParams(max_tokens=10, temperature=temperature, n=2, seed=3, ignore_eos=True)
    eng.add_request("bad", None, bad, prompt_token_ids=ps[1])
    done = _run_all(eng)
    failed = done["bad"]
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert "not finite" in failed.error and "float64" in failed.error
    assert all(len(c.token_ids) == 3 for c in failed.outputs)  # the tokens before the overflow
    assert [done[str(i)].outputs[0].token_ids for i in range(4)] == want


def test_huge_finite_logits_are_not_taken_for_an_overflow(monkeypatch):
    # logits that are all finite but whose sum overflows float32 (the engine's first check is
    # one sum over the batch): every request still decodes, greedy picks the huge entry
    model = make_model()
    eng = make_engine(model)
    original = eng.runner.decode

    def huge(items):
        logits = original(items)
        logits[:, 5] = 3e38
        logits[:, 6] = 2e38
        return logits

    monkeypatch.setattr(eng.runner, "decode", huge)
    for i, p in enumerate(prompts()[:3]):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    done = _run_all(eng)
    for out in done.values():
        assert out.error is None
        assert out.outputs[0].token_ids[1:] == [5] * (GREEDY.max_tokens - 1)


def test_nan_model_fails_at_prefill_with_a_clear_error():
    # a real model whose every logit is NaN (a poisoned final norm): the first token already
    # fails, alone and in a batched prefill, and the pools come back whole (fixture)
    model = make_model()
    with torch.no_grad():
        model.norm.weight.fill_(float("nan"))
    eng = make_engine(model)
    for i, p in enumerate(prompts()[:3]):
        eng.add_request(str(i), None, GREEDY, prompt_token_ids=p)
    done = _run_all(eng)
    assert len(done) == 3
    for out in done.values():
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert "not finite" in out.error
