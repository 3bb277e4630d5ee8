"""The embedded default model: ships with the package, loads, is deterministic, and
keeps the model invariants."""

import json
from importlib import resources

import torch

from mcserve.config import ModelConfig
from mcserve.engine.llm import LLM
from mcserve.engine.sampling import SamplingParams
from mcserve.engine.tokenizer import Tokenizer
from mcserve.models.native import MCForCausalLM


def _model_dir():
    return resources.files("mcserve") / "assets" / "default_model"


def test_shipped_files_and_config():
    d = _model_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "MODEL_CARD.md"):
        assert (d / name).is_file(), name
    cfg = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    assert cfg.mc_variant != "none" and cfg.vocab_size == Tokenizer.from_dir(d).vocab_size


def test_greedy_is_deterministic_and_chat_template_renders():
    llm = LLM()  # no model named: the embedded default
    params = SamplingParams(max_tokens=16, temperature=0.0)
    a = llm.generate(["It is a truth universally acknowledged"], params)[0].outputs[0]
    b = llm.generate(["It is a truth universally acknowledged"], params)[0].outputs[0]
    assert a.token_ids == b.token_ids and a.text == b.text and a.token_ids
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "Hi" in prompt
    assert llm.engine.cache.is_whole()


def test_forward_equals_prefill_plus_decode():
    model = MCForCausalLM.from_pretrained(str(_model_dir()))
    tok = Tokenizer.from_dir(_model_dir())
    ids = torch.tensor([tok.encode("The passkey is 12345. Remember it. " * 6)])[:, :150]
    with torch.no_grad():
        full, _ = model(ids)
        logits, state = model(ids[:, :100])
        outs = [logits]
        for t in range(100, ids.shape[1]):
            logits, state = model(ids[:, t:t + 1], state)
            outs.append(logits)
    dec = torch.cat(outs, 1)
    assert ((dec - full).norm() / full.norm()).item() < 1e-5
