"""Every imported checkpoint format served over HTTP, queried with the official ``openai`` client.

Each format is a tiny random model written in its real file format (the writers of the format's
own test file), loaded by path into the real engine and served by the real OpenAI-compatible app
in process (``build_app``; the ``openai`` client talks to it through ``TestClient``, an
``httpx.Client``). Completions and chat, streaming and not, greedy: the streamed text equals the
plain one, and the plain completion is the engine's own offline greedy continuation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from fastapi.testclient import TestClient  # noqa: E402

from mcserve.engine.llm import LLM  # noqa: E402
from mcserve.engine.sampling import SamplingParams  # noqa: E402
from mcserve.models.registry import detect_format  # noqa: E402
from mcserve.server.app import build_app  # noqa: E402

API_KEY = "sk-imported"
PROMPT = "Memory caching"
N_TOKENS = 6
# random weights may say their end-of-text id at any point: every answer is N_TOKENS long
EXTRA = {"ignore_eos": True}


def _fla_delta(model_type: str) -> Callable[[Path], Path]:
    def write(d: Path) -> Path:
        from test_fla_delta import build_ref, fla_config

        kw = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_heads=2,
                  intermediate_size=48)
        if model_type == "gated_deltanet":
            kw.update(head_dim=8, expand_v=2.0, use_gate=True)
        return build_ref(fla_config(model_type, **kw), seed=1).save(d / "model")

    return write


def _rwkv7_pth(d: Path) -> Path:
    pytest.importorskip("rwkv")  # the World tokenizer's vocabulary
    from test_rwkv7 import blinkdl_state_dict

    path = d / "rwkv7.pth"
    torch.save(blinkdl_state_dict(n_layer=1, C=64, vocab=65536, ffn=64, seed=4), path)
    return path


def _rwkv7_fla(d: Path) -> Path:
    pytest.importorskip("rwkv")
    from safetensors.torch import save_file
    from test_rwkv7 import _to_fla, blinkdl_state_dict

    out = d / "rwkv7-fla"
    out.mkdir()
    cfg = {"model_type": "rwkv7", "hidden_size": 64, "num_hidden_layers": 1, "head_dim": 64,
           "vocab_size": 65536, "norm_eps": 1e-5, "eos_token_id": 0, "bos_token_id": 0}
    (out / "config.json").write_text(json.dumps(cfg))
    sd = _to_fla(blinkdl_state_dict(n_layer=1, C=64, vocab=65536, ffn=64, seed=5))
    save_file({k: t.contiguous() for k, t in sd.items()}, str(out / "model.safetensors"))
    return out


def _hf_mamba() -> torch.nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(2)
    return MambaForCausalLM(MambaConfig(
        vocab_size=256, hidden_size=24, num_hidden_layers=2, state_size=8, conv_kernel=4,
        expand=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


def _mamba_hf(d: Path) -> Path:
    pytest.importorskip("transformers")
    _hf_mamba().save_pretrained(d / "mamba-hf")
    return d / "mamba-hf"


def _mamba_ssm(d: Path) -> Path:
    pytest.importorskip("transformers")
    from test_mamba1 import write_mamba_ssm

    return write_mamba_ssm(_hf_mamba(), d / "mamba-ssm", 256)


def _fla_gla(d: Path) -> Path:
    from safetensors.torch import save_file
    from test_fla_gla import BASE, RefGLAForCausalLM

    torch.manual_seed(3)
    c = {**BASE, "vocab_size": 256}
    ref = RefGLAForCausalLM(c).eval()
    out = d / "gla"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(c))
    save_file({k: t.detach().contiguous() for k, t in ref.state_dict().items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# name: (writer, the (model_type, layout) that detect_format must see)
FORMATS: dict[str, tuple[Callable[[Path], Path], tuple[str, str]]] = {
    "fla-deltanet": (_fla_delta("delta_net"), ("delta_net", "transformers")),
    "fla-gated-deltanet": (_fla_delta("gated_deltanet"), ("gated_deltanet", "transformers")),
    "rwkv7-blinkdl-pth": (_rwkv7_pth, ("rwkv7", "blinkdl")),
    "rwkv7-fla-dir": (_rwkv7_fla, ("rwkv7", "transformers")),
    "mamba-transformers": (_mamba_hf, ("mamba", "transformers")),
    "mamba-mamba_ssm": (_mamba_ssm, ("mamba", "mamba_ssm")),
    "fla-gla": (_fla_gla, ("gla", "transformers")),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_served_with_the_openai_client(fmt: str, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    write, want_format = FORMATS[fmt]
    path = write(tmp_path)
    assert detect_format(path) == want_format
    llm = LLM(str(path), max_num_seqs=4, max_model_len=256, dtype="float32")
    tok = llm.get_tokenizer()
    offline = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N_TOKENS,
                                                    ignore_eos=True))[0].outputs[0]
    app = build_app(llm.engine, api_key=API_KEY, served_model_name=fmt)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url=str(http.base_url) + "/v1", api_key=API_KEY,
                               http_client=http, max_retries=0)
        assert [m.id for m in client.models.list()] == [fmt]

        plain = client.completions.create(model=fmt, prompt=PROMPT, max_tokens=N_TOKENS,
                                          temperature=0, extra_body=EXTRA)
        assert plain.usage is not None and plain.usage.completion_tokens == N_TOKENS
        assert plain.usage.prompt_tokens == len(tok.encode(PROMPT))
        assert plain.choices[0].text == offline.text == tok.decode(offline.token_ids)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(model=fmt, prompt=PROMPT, max_tokens=N_TOKENS,
                                               temperature=0, stream=True, extra_body=EXTRA)
            if c.choices)
        assert streamed == plain.choices[0].text

        msgs = [{"role": "user", "content": "Hello there"}]
        chat = client.chat.completions.create(model=fmt, messages=msgs, max_tokens=N_TOKENS,
                                              temperature=0, extra_body=EXTRA)
        assert chat.usage is not None and chat.usage.completion_tokens == N_TOKENS
        assert chat.choices[0].message.role == "assistant"
        chunks = list(client.chat.completions.create(
            model=fmt, messages=msgs, max_tokens=N_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=EXTRA))
        assert ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                == chat.choices[0].message.content)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == N_TOKENS


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_eval_ppl_and_passkey_run_on_every_format(fmt: str, tmp_path: Path) -> None:
    """``mcserve eval ppl`` and ``passkey`` load every imported format and report the model as
    is beside post-hoc MC settings."""
    from mcserve.cli import main

    torch.set_num_threads(1)
    path = FORMATS[fmt][0](tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("The grass is green and the sky is blue. " * 20)
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", str(path), "--data", str(text), "--lengths", "48", "--mc",
                 "post:16,grm:16", "--no-progress", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert "post" in json.dumps(rows) and "grm" in json.dumps(rows)
    out = tmp_path / "passkey.json"
    assert main(["eval", "passkey", str(path), "--lengths", "320", "--depths", "0.5",
                 "--trials", "1", "--mc", "post:16", "--no-progress", "--json", str(out)]) == 0
    assert "post" in out.read_text()
