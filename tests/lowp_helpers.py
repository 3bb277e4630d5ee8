"""What the low-precision suites (tests/test_lowp_linear.py, tests/test_hybrid_lowp.py) share."""

from __future__ import annotations


def generate(model, prompts: list[list[int]], *, max_tokens: int,
             **engine) -> list[tuple[list[int], list[float]]]:
    """Greedy ``max_tokens`` tokens of each prompt through an engine on ``model`` (prefix caching
    off; ``engine``: the other EngineConfig fields, the suite's sizes), in prompt order: the
    tokens and the logprob of each."""
    from mcserve.config import EngineConfig
    from mcserve.engine.llm_engine import LLMEngine
    from mcserve.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    eng = LLMEngine(EngineConfig(enable_prefix_caching=False, **engine), model=model)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), None, params, prompt_token_ids=p)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                c = o.outputs[0]
                out[int(o.request_id)] = (list(c.token_ids),
                                          [d[t].logprob for d, t in zip(c.logprobs, c.token_ids,
                                                                        strict=True)])
    return [out[i] for i in range(len(prompts))]
