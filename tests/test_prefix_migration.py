"""Prefix export / import between engines (``LLMEngine.export_prefix`` / ``import_prefix``):
the state a replica migrates to another instead of recomputing a prefill. In-process, no Ray."""

import pickle

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.prefix_keys import salt_digest
from mcserve.engine.sampling import SamplingParams
from mcserve.engine.state_cache import PrefixExport
from mcserve.models.native import MCForCausalLM

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEG = 4


def make_model(memory: str = "linear", variant: str = "grm", mode: str = "checkpoint",
               seed: int = 0) -> MCForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=2, head_dim=8,
                      memory=memory, mc_variant=variant, mc_mode=mode, segment_len=SEG,
                      mc_top_k=1, inner_chunk=2, memory_expansion=2)
    return MCForCausalLM(cfg).double()


ENGINES: list[LLMEngine] = []


def make_engine(model_kw: dict | None = None, **kw: object) -> LLMEngine:
    args: dict = dict(max_num_seqs=4, num_state_blocks=64, max_num_batched_tokens=32,
                      dtype="float64", max_model_len=128)
    args.update(kw)
    eng = LLMEngine(EngineConfig(**args), model=make_model(**(model_kw or {})))
    ENGINES.append(eng)
    return eng


@pytest.fixture(autouse=True)
def pools_whole_after():
    ENGINES.clear()
    yield
    for eng in ENGINES:
        assert not eng.has_unfinished_requests()
        assert eng.cache.is_whole(), "a block or slot leaked"


def prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def generate(eng: LLMEngine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return LLM(engine=eng).generate([ids], params)[0].outputs[0].token_ids


COMBOS = [
    pytest.param("linear", "grm", "checkpoint", id="linear-grm"),
    pytest.param("linear", "ssc", "independent", id="linear-ssc-indep"),
    pytest.param("dla", "soup", "checkpoint", id="dla-soup"),
    pytest.param("swla", "residual", "checkpoint", id="swla-residual"),
]


@pytest.mark.parametrize("memory,variant,mode", COMBOS)
def test_export_import_is_token_identical_to_recompute(memory, variant, mode):
    kw = dict(memory=memory, variant=variant, mode=mode)
    a, b, c = make_engine(kw), make_engine(kw), make_engine(kw)
    system = prompt(41)  # 10 whole segments and a bit
    turn = system + prompt(7, seed=2)
    generate(a, system)  # A computes (and caches) the shared prefix
    export = a.export_prefix(turn)
    assert export.num_blocks == len(system) // SEG
    assert export.hashes == a.prefix_hashes(turn)[:export.num_blocks]
    # through pickle, as Ray's object store carries it
    export = pickle.loads(pickle.dumps(export))
    assert b.import_prefix(export) == export.num_blocks
    assert b.cached_prefix_blocks(b.prefix_hashes(turn)) == export.num_blocks
    hits0 = b.cache.prefix_hits
    out_b = generate(b, turn)
    assert b.cache.prefix_hits - hits0 == export.num_blocks  # resumed, not recomputed
    assert out_b == generate(c, turn)  # C recomputes everything
    assert c.cache.prefix_hits == 0
    # the imported blocks are ordinary cached blocks: nobody holds them, they can be evicted
    assert not any(b.cache.ref)
    assert b.cache.num_free_blocks == b.cache.num_blocks


def test_import_skips_cached_blocks_and_stops_at_a_full_pool():
    a = make_engine()
    ids = prompt(61)
    generate(a, ids)
    export = a.export_prefix(ids + [5])
    assert export.num_blocks == 15
    b = make_engine(num_state_blocks=6)
    assert b.import_prefix(export) == 6  # as many as the pool holds
    assert b.import_prefix(export) == 0  # the first six are cached, no room for more
    assert b.cached_prefix_blocks(export.hashes) == 6
    c = make_engine()
    half = PrefixExport(export.hashes[:5], export.salt_digest,
                        [{k: t[:5] for k, t in layer.items()} for layer in export.layers])
    assert c.import_prefix(half) == 5
    assert c.import_prefix(export) == 10  # only the missing ones are written
    assert c.cache.num_imported == 15
    assert generate(c, ids) == generate(make_engine(), ids)


def test_export_of_nothing_cached_and_engines_without_blocks():
    a = make_engine()
    empty = a.export_prefix(prompt(30))
    assert empty.num_blocks == 0 and empty.nbytes == 0
    assert make_engine().import_prefix(empty) == 0
    for kw in (dict(variant="none"), dict(memory="swla", variant="loglinear")):
        eng = make_engine(kw)
        ids = prompt(30)
        generate(eng, ids)
        assert eng.prefix_hashes(ids) == []
        assert eng.export_prefix(ids).num_blocks == 0
    off = make_engine(enable_prefix_caching=False)
    generate(off, prompt(30))
    assert off.export_prefix(prompt(30)).num_blocks == 0


def test_import_refuses_another_model_or_configuration():
    a = make_engine()
    ids = prompt(30)
    generate(a, ids)
    export = a.export_prefix(ids)
    other = make_engine(dict(variant="soup"))  # other salt
    with pytest.raises(ValueError, match="another model"):
        other.import_prefix(export)
    # same salt but blocks of another shape: refused before anything is written
    forged = PrefixExport(export.hashes, salt_digest(other.cache.salt),
                          [{k: t[..., :1] for k, t in layer.items()} for layer in export.layers])
    with pytest.raises(ValueError, match="does not match"):
        other.import_prefix(forged)
    assert other.cache.num_imported == 0


def test_per_request_top_k_salts_the_exported_prefix():
    kw = dict(variant="ssc", mode="independent")
    a, b = make_engine(kw), make_engine(kw)
    ids = prompt(33)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    a.add_request("r", None, params, prompt_token_ids=ids, mc_overrides={"mc_top_k": 2})
    while a.has_unfinished_requests():
        a.step()
    assert a.export_prefix(ids).num_blocks == 0  # cached under top_k=2 only
    export = a.export_prefix(ids, mc_overrides={"mc_top_k": 2})
    assert export.num_blocks == 8
    b.import_prefix(export)
    b.add_request("r", None, params, prompt_token_ids=ids, mc_overrides={"mc_top_k": 2})
    while b.has_unfinished_requests():
        b.step()
    assert b.cache.prefix_hits == 8


def test_requests_sharing_a_new_prefix_compute_it_once():
    """Requests arriving together with the same uncached prefix (a shared system prompt): the
    first computes it, the others wait for its blocks and compute only their own tails; the
    outputs are those of separate engines."""
    eng = make_engine(max_num_batched_tokens=128)
    system = prompt(41)  # 10 whole segments
    turns = [system + prompt(9, seed=10 + i) for i in range(3)]
    for i, ids in enumerate(turns):
        eng.add_request(f"r{i}", None, GREEDY, prompt_token_ids=ids)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert [outs[f"r{i}"].num_cached_tokens for i in range(3)] == [0, 40, 40]
    assert eng.cache.prefix_hits == 20
    for i, ids in enumerate(turns):
        assert outs[f"r{i}"].outputs[0].token_ids == generate(make_engine(), ids)
