"""Constrained decoding in the engine (structured outputs, llguidance) on the embedded default
model: a weak model, but under a constraint its output must validate.

The random schemas bound what a model could otherwise write without end (strings by
``maxLength`` or a bounded pattern, numbers by ``multipleOf``, objects closed by
``additionalProperties: false``): the constraint guarantees the output's form, not that a weak
model ever closes an unbounded string; such an output ends at ``max_tokens`` with finish reason
``length`` (``test_json_object`` shows it).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
from typing import Any

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from mcserve.config import EngineConfig, ModelConfig  # noqa: E402
from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.llm_engine import LLMEngine  # noqa: E402
from mcserve.engine.sampling import apply_token_bitmask  # noqa: E402
from mcserve.engine.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from mcserve.engine.tokenizer import Tokenizer  # noqa: E402
from mcserve.errors import InvalidRequestError  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

WORDS = ["red", "green", "blue", "cat", "dog", "x y", "Zürich", 'a"b', "line\nbreak"]
PATTERNS = [r"^[a-z]{1,6}$", r"^[A-Z][0-9]{2}-[a-z]{1,4}$", r"^(yes|no)$", r"^[0-9]{3}$"]


def leaf_schema(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "number", "boolean", "enum", "pattern", "string", "null",
                       "const"])
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 5000)}
    if kind == "number":
        lo = round(rng.uniform(-100, 100), 2)
        return {"type": "number", "minimum": lo, "maximum": round(lo + rng.uniform(0.5, 500), 2),
                # powers of two: jsonschema checks multipleOf in binary floating point, where
                # 10.11 / 0.01 is not a whole number
                "multipleOf": rng.choice([0.5, 0.25, 0.125, 1])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 1, 2.5, None, True], rng.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 12)}
    if kind == "null":
        return {"type": "null"}
    return {"const": rng.choice(WORDS)}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """Nested objects (required and optional fields), arrays with item bounds, enums, bounded
    integers and numbers, strings with patterns or length bounds, constants, nulls."""
    r = rng.random()
    if depth < 2 and r < 0.3:
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    if depth == 0 or (depth < 2 and r < 0.7):
        props = {f"k{i}_{rng.choice(WORDS[:5])}": random_schema(rng, depth + 1)
                 for i in range(rng.randint(1, 4))}
        return {"type": "object", "properties": props,
                "required": [p for p in props if rng.random() < 0.7],
                "additionalProperties": False}
    return leaf_schema(rng)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64)


def generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[Any]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o in outs:
        assert o.error is None, o.error
    return outs


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schemas_validate(llm: LLM, seed: int) -> None:
    """160 random schemas (80 per seed), each greedy and sampled: every output parses, follows
    its schema and ended because the constraint was complete (finish reason ``stop``)."""
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(80)]
    prompts = [rng.choice(["Here is the record as JSON: ", "The answer:", "{"])
               for _ in schemas]
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=1000 * seed + i, max_tokens=400,
                                 structured_outputs={"json": s})
                  for i, s in enumerate(schemas)]
        for schema, out in zip(schemas, generate(llm, prompts, params), strict=True):
            c = out.outputs[0]
            assert c.finish_reason == "stop", (schema, c.text)
            jsonschema.validate(json.loads(c.text), schema)


REGEXES = [r"[0-9]{3}-[a-z]{2,5}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8}){0,2}",
           r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"-?[0-9]{1,4}\.[0-9]{2}", r"[a-f0-9]{8}",
           r"(ab|cd){1,4}x", r"[^\n]{1,12}\.", r"(\+|-)[0-9]{2}", r"[αβγ]{2,3}!"]


def test_regexes_match(llm: LLM) -> None:
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60,
                             structured_outputs={"regex": rx})
              for t in (0.0, 1.0) for i, rx in enumerate(REGEXES)]
    outs = generate(llm, ["The value is "] * len(params), params)
    for p, out in zip(params, outs, strict=True):
        c = out.outputs[0]
        assert p.structured_outputs is not None and p.structured_outputs.regex is not None
        assert re.fullmatch(p.structured_outputs.regex, c.text), (p.structured_outputs, c.text)
        assert c.finish_reason == "stop"


def test_choice_grammar_and_gbnf(llm: LLM) -> None:
    choices = ["positive", "negative", "neutral", 'with "quotes"', "naïve"]
    lark = 'start: expr\nexpr: NUM ("+" NUM){0,3}\nNUM: /[0-9]{1,3}/'
    gbnf = 'root ::= "yes" | "no" | ("maybe " [a-z]{1,5})'
    params = []
    for t in (0.0, 1.0):
        for i in range(3):
            params += [
                SamplingParams(temperature=t, seed=i, max_tokens=20,
                               structured_outputs={"choice": choices}),
                SamplingParams(temperature=t, seed=i, max_tokens=40,
                               structured_outputs={"grammar": lark}),
                SamplingParams(temperature=t, seed=i, max_tokens=20,
                               structured_outputs={"grammar": gbnf})]
    outs = generate(llm, ["The sentiment is "] * len(params), params)
    for p, out in zip(params, outs, strict=True):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        so = p.structured_outputs
        assert so is not None
        if so.choice is not None:
            assert text in choices
        elif so.grammar == lark:
            assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3}){0,3}", text), text
        else:
            assert re.fullmatch(r"yes|no|maybe [a-z]{1,5}", text), text


def test_json_object(llm: LLM) -> None:
    """``json_object``: the output opens a JSON object, and one that the constraint ended
    parses as one. The default model often writes a key without end: those end at
    ``max_tokens`` (``length``)."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                             structured_outputs={"json_object": True}) for i in range(8)]
    outs = generate(llm, ["Data as JSON: "] * 8, params)
    for out in outs:
        c = out.outputs[0]
        assert c.text.startswith("{")
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
    assert any(o.outputs[0].finish_reason == "stop" for o in outs)


def test_n_completions_each_constrained(llm: LLM) -> None:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}}, "required": ["name", "tags"], "additionalProperties": False}
    out = generate(llm, ["A record: "], [SamplingParams(
        n=6, temperature=1.0, seed=7, max_tokens=80, structured_outputs={"json": schema})])[0]
    assert len(out.outputs) == 6
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # the completions sample apart


def test_logprobs_are_those_of_the_masked_distribution(llm: LLM) -> None:
    """Under a constraint the reported logprobs are the model's distribution renormalised over
    the allowed tokens (vLLM's convention: the mask is applied before the sampler): at each
    step the allowed alternatives' probabilities sum to 1, disallowed tokens are -inf, and the
    cumulative logprob is the sum of the chosen tokens'."""
    choices = ["yes", "no"]
    out = generate(llm, ["Is it true? "], [SamplingParams(
        temperature=0, max_tokens=10, logprobs=20, structured_outputs={"choice": choices})])[0]
    c = out.outputs[0]
    assert c.text in choices and c.logprobs is not None
    first = c.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if math.isfinite(lp.logprob)}
    assert 1 <= len(finite) < 20  # "y", "yes", "n", "no"...: fewer than 20 tokens allowed
    assert math.isclose(sum(math.exp(v) for v in finite.values()), 1.0, rel_tol=1e-4)
    assert any(lp.logprob == -math.inf for lp in first.values())
    # greedy takes the most likely allowed token
    assert c.token_ids[0] == max(finite, key=finite.get)
    total = sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True))
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-5)
    # the same token unconstrained has a lower logprob (the mass outside the choices is gone)
    free = generate(llm, ["Is it true? "], [SamplingParams(temperature=0, max_tokens=1,
                                                           logprobs=20)])[0].outputs[0]
    assert free.logprobs is not None
    raw = free.logprobs[0].get(c.token_ids[0])
    if raw is not None:
        assert raw.logprob < first[c.token_ids[0]].logprob


def test_finish_reasons(llm: LLM) -> None:
    """A complete constraint ends the completion at once with ``stop`` (no EOS token needed);
    ``max_tokens`` before that is ``length``; EOS is never allowed before the end."""
    eos = llm.get_tokenizer().eos_token_id
    done, cut = generate(llm, ["Answer: "] * 2, [
        SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["banana"]}),
        SamplingParams(temperature=0, max_tokens=2,
                       structured_outputs={"regex": "[a-z]{20}"})])
    assert done.outputs[0].text == "banana" and done.outputs[0].finish_reason == "stop"
    assert eos not in done.outputs[0].token_ids
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 2
    # a grammar that may end or go on: EOS is allowed only where it may end
    out = generate(llm, ["Digits: "], [SamplingParams(
        temperature=1.0, seed=3, n=8, max_tokens=30,
        structured_outputs={"regex": "[0-9]{2}([0-9]{2})?"})])[0]
    for c in out.outputs:
        assert re.fullmatch("[0-9]{2}([0-9]{2})?", c.text) and c.finish_reason == "stop"


def test_batch_mixing_plain_and_constrained(llm: LLM) -> None:
    """The mask of a constrained row never reaches another row: plain requests batched with
    constrained ones (greedy and seeded) get the tokens they get alone."""
    prompts = ["It is a truth universally acknowledged", "The Python docs say", "Hello there"]
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)]
    alone = generate(llm, prompts, plain)
    so = {"regex": "[0-9]{5,20}"}
    mixed_params: list[SamplingParams] = []
    mixed_prompts: list[str] = []
    for p, prompt in zip(plain, prompts, strict=True):
        mixed_params += [p, SamplingParams(temperature=0, max_tokens=24, structured_outputs=so),
                         SamplingParams(temperature=0.8, seed=5, max_tokens=24,
                                        structured_outputs={"choice": ["a", "bb"]})]
        mixed_prompts += [prompt] * 3
    mixed = generate(llm, mixed_prompts, mixed_params)
    for k, ref in enumerate(alone):
        got = mixed[3 * k].outputs[0]
        assert got.token_ids == ref.outputs[0].token_ids
        assert got.cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob,
                                                       abs=1e-4)
        assert re.fullmatch("[0-9]{5,20}", mixed[3 * k + 1].outputs[0].text)


def test_bad_constraints_are_refused_with_the_field(llm: LLM) -> None:
    engine = llm.engine
    for spec in ({"regex": "(unclosed"}, {"json": {"type": "no-such-type"}},
                 {"grammar": "start: undefined_rule"}):
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("bad", "x", SamplingParams(structured_outputs=spec))
        assert e.value.param == "structured_outputs"
        assert str(e.value).startswith("structured_outputs")
        assert not engine.has_unfinished_requests()
    for spec in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": "[1,"},
                 {"nope": 1}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(structured_outputs=spec)
        assert e.value.param == "structured_outputs"


def test_compiled_constraints_are_cached(llm: LLM) -> None:
    structured = llm.engine.structured
    schema = {"type": "object", "properties": {"q": {"enum": [1, 2, 3]}}, "required": ["q"],
              "additionalProperties": False}
    before = structured.num_compiled
    # key order does not matter: the cache key is the schema's canonical JSON
    same = json.loads(json.dumps(schema, sort_keys=True))
    generate(llm, ["a", "b", "c"], [SamplingParams(max_tokens=10, structured_outputs={"json": s})
                                    for s in (schema, same, json.dumps(schema))])
    assert structured.num_compiled == before + 1


def test_byte_level_tokenizer_is_refused_clearly() -> None:
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(d_model=32, n_layers=1, n_heads=2, head_dim=16,
                                      segment_len=8))
    engine = LLMEngine(EngineConfig(max_model_len=64, num_state_blocks=32), model=model,
                       tokenizer=Tokenizer.byte_level())
    with pytest.raises(InvalidRequestError, match="tokenizer") as e:
        engine.add_request("r", "x", SamplingParams(structured_outputs={"regex": "a+"}))
    assert e.value.param == "structured_outputs"
    engine.add_request("plain", "x", SamplingParams(max_tokens=2))  # plain requests still run
    while engine.has_unfinished_requests():
        engine.step()


def test_rwkv_world_vocabulary_compiles() -> None:
    """RWKV's World tokenizer (not a ``tokenizers`` one) reaches llguidance through its token
    bytes: the allowed tokens of a regex's first step are exactly the digit strings."""
    pytest.importorskip("rwkv")
    from mcserve.engine.structured import StructuredOutputs
    from mcserve.engine.tokenizer import RWKVWorldTokenizer

    tok = RWKVWorldTokenizer()
    so = StructuredOutputs(tok, 65536)
    bits = so.fill([so.matcher(StructuredOutputsParams(regex="[0-9]{3}-ab"))])
    allowed = ((bits[0][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
    texts = {tok.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert texts and all(re.fullmatch("[0-9]{1,3}(-a?)?", t) for t in texts)
    assert {"0", "9", "12"} <= texts


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernel", "twin"])
def test_apply_token_bitmask_matches_a_reference(kernels: bool) -> None:
    """The batch's masks are applied at once (bit t % 32 of word t // 32), only in the
    constrained rows, tokens past the mask's words disallowed; the input is not modified; the
    C++ kernel and its torch twin alike."""
    from mcserve.kernels import cpu

    if kernels and not cpu.enabled():
        pytest.skip(f"the C++ CPU kernels are not built here: {cpu.status()}")
    with contextlib.ExitStack() as stack:
        if not kernels:
            stack.enter_context(cpu.twins_only())
        _check_apply_token_bitmask()


def _check_apply_token_bitmask() -> None:
    g = torch.Generator().manual_seed(0)
    b, v = 5, 100  # 100 tokens: 4 words, the last one partly used
    logits = torch.randn(b, v, generator=g)
    rows = [1, 3, 4]
    allowed = torch.rand(len(rows), v, generator=g) < 0.3
    allowed[:, 0] = True
    words = torch.zeros(len(rows), 4, dtype=torch.int64)
    for r in range(len(rows)):
        for t in allowed[r].nonzero().flatten().tolist():
            words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    keep = logits.clone()
    out = apply_token_bitmask(logits, rows, bitmask)
    assert torch.equal(logits, keep)
    for r in range(b):
        if r in rows:
            ok = allowed[rows.index(r)]
            assert torch.equal(out[r][ok], logits[r][ok])
            assert bool((out[r][~ok] == -math.inf).all())
        else:
            assert torch.equal(out[r], logits[r])
    short = apply_token_bitmask(logits, rows, bitmask[:, :3])  # words for 96 tokens only
    assert bool((short[rows][:, 96:] == -math.inf).all())


def test_masks_in_the_calling_thread_equal_the_pools(llm: LLM) -> None:
    """``fill`` in the calling thread (the CPU with torch on every core) and through
    llguidance's thread pool give the same bitmasks, step after step of several matchers."""
    from mcserve.engine.structured import StructuredOutputs

    tok, V = llm.engine.tokenizer, llm.engine.model_config.vocab_size
    inline = StructuredOutputs(tok, V, inline=True)
    pooled = StructuredOutputs(tok, V, threads=2, inline=False)
    specs = [StructuredOutputsParams(json=random_schema(random.Random(s))) for s in range(4)]
    specs.append(StructuredOutputsParams(regex="[a-c]{2,5}-[0-9]+"))
    pairs = [(inline.matcher(sp), pooled.matcher(sp)) for sp in specs]
    rng = random.Random(0)
    for _ in range(12):
        a = inline.fill([p[0] for p in pairs]).clone()
        b = pooled.fill([p[1] for p in pairs]).clone()
        assert torch.equal(a, b)
        for r, (m1, m2) in enumerate(pairs):
            allowed = ((a[r][:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
            ids = allowed.nonzero().flatten().tolist()
            if ids and not m1.is_stopped():
                t = rng.choice(ids)
                assert m1.consume_token(t) and m2.consume_token(t)
