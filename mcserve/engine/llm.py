"""The offline API: ``LLM(model).generate(prompts, params)``, as in vLLM.

``generate`` and ``chat`` take vLLM's keyword arguments: ``use_tqdm`` (a progress bar over the
finished requests; True, False or a tqdm-like constructor), ``lora_request`` and ``priority``
(accepted at their defaults only: mcserve has no LoRA adapters and no priority scheduling).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from mcserve.config import EngineConfig
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.outputs import RequestOutput
from mcserve.engine.sampling import SamplingParams
from mcserve.engine.tokenizer import Tokenizer, chat_resume_positions

#: a prompt: text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
PromptType = str | Seq[int] | Mapping[str, Any]


def _progress_bar(use_tqdm: bool | Callable[..., Any], total: int) -> Any:
    """A tqdm bar over ``total`` requests (None: no bar). A callable ``use_tqdm`` is used in
    tqdm's place, as vLLM does; True uses tqdm when it is installed."""
    if not use_tqdm:
        return None
    factory = use_tqdm if callable(use_tqdm) else None
    if factory is None:
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is optional here: no bar
            return None
        factory = tqdm
    return factory(total=total, desc="Processed prompts", dynamic_ncols=True)


def _check_unsupported(lora_request: Any, priority: Seq[int] | None, n: int) -> None:
    if lora_request is not None:
        raise ValueError("lora_request is not supported: mcserve serves no LoRA adapters "
                         "(pass lora_request=None)")
    if priority is not None:
        prio = list(priority)
        if len(prio) != n:
            raise ValueError(f"priority has {len(prio)} entries for {n} prompts")
        if any(p != 0 for p in prio):
            raise ValueError("priority is not supported: mcserve schedules requests first come, "
                             "first served (pass priority=None or zeros)")


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
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's accessor for :attr:`tokenizer`."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        priority: Seq[int] | None = None,
        resume_positions: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        A prompt is a string, a list of token ids, or a dict with ``"prompt"`` (text) or
        ``"prompt_token_ids"``, and optionally ``"resume_positions"``: token positions of the
        prompt where the engine keeps a resume point (the end of a document or a system prompt
        that later prompts share; they then compute only what follows). ``resume_positions``
        applies to every prompt without its own. ``use_tqdm`` shows a progress bar over
        finished requests (True: tqdm when installed; a callable: called like tqdm's
        constructor with ``total``, ``desc`` and ``dynamic_ncols``). ``lora_request`` must be
        None and ``priority`` None or all zeros (ValueError otherwise)."""
        if isinstance(prompts, (str, Mapping)) or (
                isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        _check_unsupported(lora_request, priority, len(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added = []
        bar = None
        try:
            for rid, prompt, p in zip(ids, prompts, params, strict=True):
                text, token_ids = self._split_prompt(prompt)
                marks = (prompt.get("resume_positions", resume_positions)
                         if isinstance(prompt, Mapping) else resume_positions)
                self.engine.add_request(rid, text, p, prompt_token_ids=token_ids,
                                        resume_positions=None if marks is None else list(marks))
                added.append(rid)
            bar = _progress_bar(use_tqdm, len(ids))
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    @staticmethod
    def _split_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
        """(text, token ids) of one prompt; exactly one of them is None."""
        if isinstance(prompt, str):
            return prompt, None
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], None
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return None, list(prompt)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, through the chat template
        (``chat_template``: a Jinja template used instead of the tokenizer's own). The rendered
        text is tokenized without adding special tokens (the template writes its own BOS). The
        engine keeps resume points where messages end (``chat_resume_positions``), so the next
        turn of a conversation computes only its new tokens."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tok = self.tokenizer
        prompts: list[PromptType] = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           chat_template=chat_template)
            ids = tok.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids,
                            "resume_positions": chat_resume_positions(
                                tok, conv, ids, chat_template=chat_template)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)
