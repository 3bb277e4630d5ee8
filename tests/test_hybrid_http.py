"""A hybrid model (LFM2: gated short convolutions and attention) served over HTTP with its own
chat template, queried with the official ``openai`` client: chat, streaming, and the next turn
of a conversation resuming from the first turn's end (attention KV and conv state of one token)
with the same answer as an engine without reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402

API_KEY = "sk-hybrid"
# LFM2's ChatML-style template
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXTRA = {"ignore_eos": True}


def _lfm2_dir(d: Path) -> Path:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import Lfm2Config, Lfm2ForCausalLM

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|startoftext|>", "<|im_end|>", "<|im_start|>",
                                        "<|pad|>"],
        show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello there, how are you today?", "a recurrent state"] * 4,
                            trainer)
    torch.manual_seed(5)
    cfg = Lfm2Config(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=192,
                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     block_multiple_of=16, bos_token_id=0, eos_token_id=1, pad_token_id=3,
                     layer_types=["conv", "full_attention", "conv", "full_attention"])
    out = d / "lfm2"
    Lfm2ForCausalLM(cfg).eval().save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "chat_template": TEMPLATE}))
    return out


def test_hybrid_chat_over_http_resumes_the_conversation(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    path = _lfm2_dir(tmp_path)
    llm = LLM(str(path), max_num_seqs=4, max_model_len=512, kv_cache_mib=8)
    fresh = LLM(str(path), max_num_seqs=4, max_model_len=512, kv_cache_mib=8,
                enable_prefix_caching=False)
    app = build_app(llm.engine, api_key=API_KEY, served_model_name="lfm2-tiny")
    with TestClient(app) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key=API_KEY,
                               http_client=http, max_retries=0)
        msgs = [{"role": "system", "content": "a recurrent state"},
                {"role": "user", "content": "hello there"}]
        first = client.chat.completions.create(model="lfm2-tiny", messages=msgs,
                                               max_tokens=8, temperature=0, extra_body=EXTRA)
        assert first.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(
            model="lfm2-tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
            extra_body=EXTRA))
        assert ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                == first.choices[0].message.content)
        msgs2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "how are you today?"}]
        second = client.chat.completions.create(model="lfm2-tiny", messages=msgs2,
                                                max_tokens=8, temperature=0, extra_body=EXTRA)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
    want = fresh.chat([msgs2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                      use_tqdm=False)[0]
    assert second.choices[0].message.content == want.outputs[0].text
