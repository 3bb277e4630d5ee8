"""``mcserve.engine.llm.LLM`` takes vLLM's keyword arguments (use_tqdm, lora_request, priority)."""

from __future__ import annotations

import sys

import pytest
import torch

from mcserve.config import EngineConfig, ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.llm_engine import LLMEngine
from mcserve.engine.sampling import SamplingParams
from mcserve.models.native import MCForCausalLM

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.manual_seed(0)
    model = MCForCausalLM(ModelConfig(vocab_size=256, d_model=32, n_layers=1, n_heads=2,
                                      head_dim=8, segment_len=4))
    eng = LLMEngine(EngineConfig(max_num_seqs=4, max_model_len=64, num_state_blocks=64),
                    model=model)
    return LLM(engine=eng)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


class FakeBar:
    made: list[FakeBar] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.n = 0
        self.closed = False
        FakeBar.made.append(self)

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        self.closed = True


def test_use_tqdm_callable_counts_finished_requests(llm: LLM) -> None:
    FakeBar.made.clear()
    want = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert FakeBar.made == []
    got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=FakeBar))
    assert got == want
    (bar,) = FakeBar.made
    assert bar.kwargs["total"] == 3 and bar.n == 3 and bar.closed


def test_use_tqdm_true_draws_a_bar_when_tqdm_is_installed(llm: LLM, capsys) -> None:
    pytest.importorskip("tqdm")
    llm.generate(PROMPTS, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_use_tqdm_without_tqdm_installed_shows_nothing(llm: LLM, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=True)) == 3
    assert "Processed prompts" not in capsys.readouterr().err


def test_lora_request_none_accepted_other_refused(llm: LLM) -> None:
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=None)) == 1
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=object())
    with pytest.raises(ValueError, match="lora_request"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, lora_request=object())
    assert not llm.engine.has_unfinished_requests()


def test_priority(llm: LLM) -> None:
    assert len(llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 0, 0])) == 3
    with pytest.raises(ValueError, match="priority"):
        llm.generate(PROMPTS, GREEDY, priority=[0, 1, 0])
    with pytest.raises(ValueError, match="priority"):
        llm.generate(PROMPTS, GREEDY, priority=[0])


def test_prompt_forms(llm: LLM) -> None:
    want = _tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))
    for prompt in (PROMPTS[0], {"prompt_token_ids": PROMPTS[0]}, [PROMPTS[0]]):
        assert _tokens(llm.generate(prompt, GREEDY, use_tqdm=False)) == want
    text = _tokens(llm.generate("ab", GREEDY, use_tqdm=False))
    assert _tokens(llm.generate({"prompt": "ab"}, GREEDY, use_tqdm=False)) == text
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"text": "ab"}, GREEDY)


def test_chat_takes_use_tqdm(llm: LLM) -> None:
    FakeBar.made.clear()
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
    outs = llm.chat(convs, GREEDY, use_tqdm=FakeBar)
    assert len(outs) == 2 and FakeBar.made[0].n == 2
    # the template's text is the prompt; it is tokenized without extra special tokens
    text = llm.tokenizer.apply_chat_template(convs[0], add_generation_prompt=True)
    assert outs[0].prompt == text
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
