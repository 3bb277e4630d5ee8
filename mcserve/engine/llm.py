"""The offline API: ``LLM(model).generate(prompts, params)``, as in vLLM."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from mcserve.config import EngineConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.outputs import RequestOutput
from mcserve.engine.sampling import SamplingParams


class LLM:
    """Batch generation over the engine (continuous batching, prefix reuse, preemption).

    ``model`` is a checkpoint directory (None: the embedded default model); other keyword
    arguments are ``EngineConfig`` fields, e.g. ``LLM(path, mc_variant="post", segment_len=2048)``.
    """

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None,
                 **engine_args: Any):
        self.engine = engine or LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                if isinstance(prompt, str):
                    self.engine.add_request(rid, prompt, p)
                else:
                    self.engine.add_request(rid, None, p, prompt_token_ids=list(prompt))
                added.append(rid)
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True)
                   for c in convs]
        return self.generate(prompts, sampling_params)
