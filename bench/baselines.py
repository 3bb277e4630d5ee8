"""Baselines that `offline.py --compare` and `serving.py --compare` run in the same process run:
transformers `generate` and llama.cpp (through llama-cpp-python's low-level batched API) on one
Mamba2 checkpoint, next to mcserve's engine on the same weights.

The checkpoint is the 130M Mamba2 shape (hidden 768, 24 layers, state 128, head_dim 64, 24 heads,
vocab 50288) with random weights from transformers' own ``Mamba2ForCausalLM`` (seeded), saved
once under ``$MCSERVE_BENCH_CACHE`` (default ``~/.cache/mcserve/bench``) with a word-level
``tokenizer.json`` so mcserve can serve it, and converted to GGUF (float32) with llama.cpp's
``convert_hf_to_gguf.py`` from a copy without the tokenizer. Nothing is downloaded. The hybrid
shapes of ``offline.py --compare --hybrids`` (an LFM2-350M-like and a Granite-4.0-H-350M-like
one, at the end of this file) are built the same way from transformers' own classes.

Every run does the same work: ``streams`` sequences, each a ``prompt_len``-token random prompt
(same ids for every implementation) followed by ``new_tokens`` greedy tokens; the reported rate
is generated tokens / wall time of the whole generate call (prefill included: it is small next to
the decode at the default sizes). Each run is repeated and the median taken.

llama.cpp set-up (bench/README.md): ``pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36``, ``pip install`` the sdist (builds llama.cpp, ~10 min on 2 cores), and
extract it; pass the extracted ``vendor/llama.cpp`` folder as ``--llama-cpp-src`` (or set
``LLAMA_CPP_SRC``) for the converter. Without the package the llama.cpp column is skipped with a
message saying so. The GGUF conversion and the batched-decode runner are in
``llama_cpp_baseline.py``; the columns' runners are built here (``llama_cpp_runner`` ...).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from llama_cpp_baseline import LlamaCppRunner, gguf_file, llama_cpp_missing, llama_cpp_src

MAMBA2_130M: dict[str, Any] = dict(
    vocab_size=50288, hidden_size=768, num_hidden_layers=24, state_size=128, head_dim=64,
    num_heads=24, n_groups=1, expand=2, conv_kernel=4, chunk_size=256,
)
# a few layers of the same width: seconds instead of minutes (CI smoke runs)
MAMBA2_QUICK: dict[str, Any] = dict(MAMBA2_130M, num_hidden_layers=2, vocab_size=4096)


def cache_dir() -> Path:
    d = Path(os.environ.get("MCSERVE_BENCH_CACHE", Path.home() / ".cache" / "mcserve" / "bench"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _word_tokenizer(vocab_size: int, path: Path) -> None:
    """A word-level tokenizer over ids ``t0 … t{V-1}``: enough for the server to take token-id
    prompts and detokenize what the random model says."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))


def bpe_tokenizer(vocab_size: int, path: Path) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (GPT-2's scheme: the 256-byte alphabet,
    ``Ġ`` for spaces, a ByteLevel decoder, ``<|endoftext|>`` as id 0) trained on this Python's
    standard-library sources (deterministic; about 5 s on 2 cores): real sub-words, for work whose
    cost depends on the tokens' bytes (constrained decoding), which ``_word_tokenizer``'s ids
    ``t0 … t{V-1}`` do not model."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sources() -> Iterator[str]:
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            if "site-packages" not in p.parts:
                try:
                    yield p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(sources(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))


def mamba2_bpe_dir(shape: dict[str, Any] = MAMBA2_130M, seed: int = 0) -> Path:
    """``mamba2_dir``'s checkpoint with ``bpe_tokenizer``'s vocabulary instead of the word-level
    one (its files linked, not copied), as ``<that name>-bpe``: built on first use, then
    reused."""
    src = mamba2_dir(shape, seed)
    out = src.with_name(src.name + "-bpe")
    if (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for f in src.iterdir():
        if f.name != "tokenizer.json":
            (tmp / f.name).symlink_to(f.resolve())
    bpe_tokenizer(shape["vocab_size"], tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def mamba2_dir(shape: dict[str, Any] = MAMBA2_130M, seed: int = 0) -> Path:
    """The random-weight Mamba2 checkpoint of ``shape`` (built on first use, then reused)."""
    return random_checkpoint_dir("mamba2", "Mamba2Config", "Mamba2ForCausalLM",
                                 dict(shape, tie_word_embeddings=True), seed)


def random_checkpoint_dir(prefix: str, config_class: str, model_class: str,
                          shape: dict[str, Any], seed: int) -> Path:
    """A random-weight transformers checkpoint of ``shape`` (``config_class(**shape)``,
    ``model_class``, seeded, ``save_pretrained``; word-level tokenizer.json) in the bench cache as
    ``<prefix>-d<hidden>-l<layers>-v<vocab>-s<seed>``: built on first use, then reused."""
    name = (f"{prefix}-d{shape['hidden_size']}-l{shape['num_hidden_layers']}"
            f"-v{shape['vocab_size']}-s{seed}")
    out = cache_dir() / name
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**shape, bos_token_id=None, eos_token_id=None,
                                              pad_token_id=0)
    model = getattr(transformers, model_class)(cfg).eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    _word_tokenizer(shape["vocab_size"], tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prompts(vocab: int, streams: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (prompt_len,), generator=g).tolist() for _ in range(streams)]


@dataclass
class Result:
    name: str
    streams: int
    tokens: int  # generated tokens per run
    seconds: list[float]
    outputs: list[list[int]]  # greedy tokens of the last run, per stream

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "streams": self.streams, "tokens": self.tokens,
                "seconds": self.seconds, "tokens_per_s": self.tokens_per_s}


# ------------------------------------------------------------------------------ mcserve


@contextlib.contextmanager
def generic_step() -> Iterator[None]:
    """Within the block the delta-rule and RWKV-7 memories have no in-place ``step_``: decode
    takes the generic path (each row's state stepped out of place, then written back to the
    slot pool), for timing the fused C++ step against it in the same run."""
    from mcserve.models.memory.delta import DeltaMemory
    from mcserve.models.memory.rwkv7 import RWKV7Memory

    saved = {cls: cls.__dict__["step_"] for cls in (DeltaMemory, RWKV7Memory)}
    for cls in saved:
        delattr(cls, "step_")
    try:
        yield
    finally:
        for cls, fn in saved.items():
            cls.step_ = fn


class McserveRunner:
    """mcserve's offline engine (``LLM.generate``), one engine per stream count; with
    ``generic`` the delta-rule / RWKV-7 decode runs without the fused state step."""

    name = "mcserve"

    def __init__(self, model_dir: Path, *, mc_variant: str = "none", generic: bool = False,
                 **engine_kw: Any):
        self.model_dir, self.mc_variant, self.engine_kw = model_dir, mc_variant, engine_kw
        self.generic = generic
        if mc_variant != "none":
            self.name = f"mcserve {mc_variant}"
        if generic:
            self.name += " (generic step)"

    def run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        with generic_step() if self.generic else contextlib.nullcontext():
            return self._run(ids, new_tokens, repeats)

    def _run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        from mcserve.engine.llm import LLM
        from mcserve.engine.sampling import SamplingParams

        max_len = len(ids[0]) + new_tokens + 1
        llm = LLM(str(self.model_dir), max_num_seqs=len(ids), max_model_len=max_len,
                  max_num_batched_tokens=max(512, len(ids) * len(ids[0])),
                  enable_prefix_caching=False, mc_variant=self.mc_variant, **self.engine_kw)
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([ids[0]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = llm.generate(ids, params)
            secs.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return Result(self.name, len(ids), len(ids) * new_tokens, secs,
                      [list(o.outputs[0].token_ids) for o in outs])


class McserveEngineRunner:
    """One mcserve engine kept for several runs (``LLM.generate``, prefix caching off so every
    prompt is computed): the weight precision comparison (``offline.py --compare
    --precisions``) interleaves its runners repeat by repeat, which spreads a shared machine's
    noise over all of them instead of one."""

    def __init__(self, model_dir: Path, name: str, max_streams: int, max_len: int,
                 **engine_kw: Any):
        from mcserve.engine.llm import LLM
        from mcserve.engine.sampling import SamplingParams

        self.name = name
        self.llm = LLM(str(model_dir), max_num_seqs=max_streams, max_model_len=max_len,
                       enable_prefix_caching=False, **engine_kw)
        self.llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)  # warm up

    def run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        from mcserve.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            outs = self.llm.generate(ids, params, use_tqdm=False)
            secs.append(time.perf_counter() - t0)
            assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
        return Result(self.name, len(ids), len(ids) * new_tokens, secs,
                      [list(o.outputs[0].token_ids) for o in outs])


# ------------------------------------------------------------------------------ transformers


class TransformersRunner:
    """transformers ``Mamba2ForCausalLM.generate`` (greedy, its own cache; on CPU it runs the
    torch fallback path, as it does for any user without the CUDA kernels). ``model_class``:
    another transformers class (``AutoModelForCausalLM`` for the hybrids). Every stream's prompt
    has the same length, so the batch needs no padding: one ``generate`` call for all streams."""

    name = "transformers"

    def __init__(self, model_dir: Path, model_class: str = "Mamba2ForCausalLM"):
        import transformers

        cls = getattr(transformers, model_class)
        self.model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        x = torch.tensor(ids)
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
        with torch.inference_mode():
            self.model.generate(x[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)
            secs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = self.model.generate(x, attention_mask=torch.ones_like(x), **kw)
                secs.append(time.perf_counter() - t0)
                assert out.shape == (len(ids), x.shape[1] + new_tokens)
        return Result(self.name, len(ids), len(ids) * new_tokens, secs,
                      out[:, x.shape[1]:].tolist())


# ------------------------------------------------------------------------------ llama.cpp


def agreement(a: Result, b: Result) -> float:
    """Fraction of streams whose greedy continuations are identical up to the first divergence
    counted per token: tokens before each stream's first mismatch / all tokens. Same weights
    give 1.0 unless float rounding flips a near-tie (random weights make near-ties common)."""
    same = 0
    for x, y in zip(a.outputs, b.outputs, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
    return same / max(1, sum(len(x) for x in a.outputs))


def llama_cpp_runner(model_dir: Path, src_arg: str | None, threads: int
                     ) -> tuple[LlamaCppRunner | None, str | None]:
    """The llama.cpp runner for ``model_dir`` (converting it on first use), or None and the
    reason to print instead of its column."""
    why = llama_cpp_missing()
    src = llama_cpp_src(src_arg)
    if why is None and src is None:
        why = ("llama.cpp column skipped: no convert_hf_to_gguf.py (pass --llama-cpp-src or set "
               "LLAMA_CPP_SRC to the sdist's vendor/llama.cpp folder)")
    if why is not None:
        return None, why
    return LlamaCppRunner(gguf_file(model_dir, src), threads), None


def llama_cpp_precision_runners(model_dir: Path, src_arg: str | None, threads: int,
                                outtypes: tuple[str, ...] = ("f32", "f16", "q8_0"),
                                **convert: Any) -> tuple[list[LlamaCppRunner], str | None]:
    """llama.cpp runners of ``model_dir`` converted to each GGUF ``outtype`` (named
    ``llama.cpp F32`` ...; ``convert``: ``gguf_file``'s ``no_vocab`` / ``layer_names``), or none
    and the reason to print instead of their columns."""
    why = llama_cpp_missing()
    src = llama_cpp_src(src_arg)
    if why is None and src is None:
        why = ("llama.cpp columns skipped: no convert_hf_to_gguf.py (pass --llama-cpp-src or "
               "set LLAMA_CPP_SRC to the sdist's vendor/llama.cpp folder)")
    if why is not None:
        return [], why.replace("llama.cpp column skipped", "llama.cpp columns skipped")
    return [LlamaCppRunner(gguf_file(model_dir, src, t, **convert), threads,
                           name=f"llama.cpp {t.upper()}") for t in outtypes], None


def describe_shape(shape: dict[str, Any]) -> str:
    return json.dumps({k: shape[k] for k in ("hidden_size", "num_hidden_layers", "state_size",
                                             "head_dim", "num_heads", "vocab_size")})


# ------------------------------------------------------------------------------ RWKV-7

#: the 0.1B RWKV-7 World shape (BlinkDL's rwkv7-g1 0.1B: 12 layers, 768 wide, head 64, the
#: LoRA ranks its trainer picks at that width)
RWKV7_01B: dict[str, Any] = dict(n_layer=12, n_embd=768, head_size=64, vocab_size=65536,
                                 d_ffn=3072, d_decay=64, d_aaa=64, d_mv=32, d_gate=128)
RWKV7_QUICK: dict[str, Any] = dict(RWKV7_01B, n_layer=2, vocab_size=4096)


def rwkv7_file(shape: dict[str, Any] = RWKV7_01B, seed: int = 0) -> Path:
    """A random-weight RWKV-7 checkpoint of ``shape`` in BlinkDL's ``.pth`` layout (float32;
    built on first use, then reused). Scales follow the trainer's ranges (mixes in (0, 1), decay
    biases around −1, small LoRAs) so the state neither vanishes nor explodes."""
    name = f"rwkv7-d{shape['n_embd']}-l{shape['n_layer']}-v{shape['vocab_size']}-s{seed}.pth"
    out = cache_dir() / name
    if out.is_file():
        return out
    g = torch.Generator().manual_seed(seed)
    C, N, V, F_ = shape["n_embd"], shape["head_size"], shape["vocab_size"], shape["d_ffn"]

    def rn(*s: int, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*s, generator=g) * std + mean

    def ru(*s: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(*s, generator=g) * (hi - lo) + lo

    sd = {"emb.weight": rn(V, C), "head.weight": rn(V, C, std=C ** -0.5),
          "ln_out.weight": rn(C, std=0.1, mean=1), "ln_out.bias": rn(C, std=0.1)}
    for i in range(shape["n_layer"]):
        p, a = f"blocks.{i}.", f"blocks.{i}.att."
        for ln in (("ln0", "ln1", "ln2") if i == 0 else ("ln1", "ln2")):
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = rn(C, std=0.1, mean=1), rn(C, std=0.1)
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            sd[a + x] = ru(1, 1, C)
        for lo, d, std0, mean0 in (("w", "d_decay", 1.0, -1.0), ("a", "d_aaa", 0.5, 0.0),
                                   ("v", "d_mv", 0.5, 1.0)):
            sd[a + lo + "0"] = rn(1, 1, C, std=std0, mean=mean0)
            sd[a + lo + "1"], sd[a + lo + "2"] = (rn(C, shape[d], std=0.1),
                                                  rn(shape[d], C, std=0.1))
        sd[a + "g1"], sd[a + "g2"] = rn(C, shape["d_gate"], std=0.1), rn(shape["d_gate"], C,
                                                                         std=0.1)
        sd[a + "k_k"], sd[a + "k_a"] = ru(1, 1, C, lo=0.5), ru(1, 1, C, lo=0.5, hi=1.5)
        sd[a + "r_k"] = rn(C // N, N, std=0.3)
        for lin in ("receptance", "key", "value", "output"):
            sd[a + lin + ".weight"] = rn(C, C, std=C ** -0.5)
        sd[a + "ln_x.weight"], sd[a + "ln_x.bias"] = rn(C, std=0.1, mean=1), rn(C, std=0.1)
        sd[p + "ffn.x_k"] = ru(1, 1, C)
        sd[p + "ffn.key.weight"] = rn(F_, C, std=C ** -0.5)
        sd[p + "ffn.value.weight"] = rn(C, F_, std=F_ ** -0.5)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(sd, tmp)
    tmp.rename(out)
    return out


class RwkvPackageRunner:
    """The ``rwkv`` package's own RWKV-7 inference (``strategy="cpu fp32"``, its CPU loop over
    tokens); it has no batching, so streams run one after another."""

    name = "rwkv package"

    def __init__(self, pth: Path):
        os.environ.update(RWKV_V7_ON="1", RWKV_JIT_ON="0", RWKV_CUDA_ON="0")
        from rwkv.model import RWKV

        self.model = RWKV(model=str(pth)[:-len(".pth")], strategy="cpu fp32")

    def _generate(self, prompt: list[int], new_tokens: int) -> list[int]:
        logits, state = self.model.forward(list(prompt), None)
        out: list[int] = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits, state = self.model.forward([out[-1]], state)
        return out

    def run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        with torch.inference_mode():
            self._generate(ids[0], 2)  # warm up
            secs = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = [self._generate(p, new_tokens) for p in ids]
                secs.append(time.perf_counter() - t0)
        return Result(self.name, len(ids), len(ids) * new_tokens, secs, out)


# ------------------------------------------------------------------------------ Gated DeltaNet

#: a 130M-class fla Gated DeltaNet: fla's GatedDeltaNetConfig at 768 wide and 12 layers, 6 heads
#: of key dim 128 and value dim 256 (expand_v 2), MLP 2/3·4·768 → 2048, 32000-token vocabulary
#: with tied embeddings: 0.138B parameters
GDN_130M: dict[str, Any] = dict(
    model_type="gated_deltanet", hidden_size=768, num_hidden_layers=12, num_heads=6,
    head_dim=128, expand_v=2.0, hidden_ratio=4, use_gate=True, use_short_conv=True,
    conv_size=4, vocab_size=32000, tie_word_embeddings=True, norm_eps=1e-6,
    hidden_act="swish", attn_mode="chunk",
)
GDN_QUICK: dict[str, Any] = dict(GDN_130M, num_hidden_layers=2, vocab_size=4096)


def gated_deltanet_dir(shape: dict[str, Any] = GDN_130M, seed: int = 0) -> Path:
    """A random-weight fla ``GatedDeltaNetForCausalLM`` directory of ``shape`` (config.json +
    model.safetensors in fla's tensor names, word-level tokenizer.json; built on first use, then
    reused). Decay parameters are spread as fla's initialiser spreads them (A in [1, 16], Δ in
    [1e-3, 0.1]) so the heads decay at different rates."""
    name = (f"gdn-d{shape['hidden_size']}-l{shape['num_hidden_layers']}"
            f"-v{shape['vocab_size']}-s{seed}")
    out = cache_dir() / name
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from safetensors.torch import save_file

    from mcserve.models.fla_delta import FlaDeltaForCausalLM, _fla_name, config_from_fla

    cfg = dict(shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = FlaDeltaForCausalLM(config_from_fla(cfg, out / "config.json"))
    with torch.no_grad():
        for layer in model.layers:
            mix = layer.mixer
            mix.A_log.copy_(torch.empty_like(mix.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(mix.dt_bias).uniform_(-6.9, -2.3))  # 1e-3 .. 0.1
            mix.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
    sd = {_fla_name(n): t.detach().contiguous() for n, t in model.state_dict().items()}
    if shape.get("tie_word_embeddings"):
        sd.pop("lm_head.weight")  # as transformers saves tied weights
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(sd, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    _word_tokenizer(shape["vocab_size"], tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ------------------------------------------------------------------------------ hybrids

#: an LFM2-350M-like shape (LiquidAI/LFM2-350M's config): 1024 wide, 16 layers with attention at
#: 2, 5, 8, 10, 12, 14 (full_attn_idxs) and gated short convs (3 taps) elsewhere, 16 heads of 64
#: with 8 KV heads, block_ff_dim 6656 auto-adjusted as transformers' Lfm2MLP does (int(2/3 ·
#: 6656) = 4437, rounded up to a multiple of 256: 4608), 65536-token vocabulary, tied embeddings
LFM2_350M: dict[str, Any] = dict(
    vocab_size=65536, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
    num_key_value_heads=8, intermediate_size=6656, block_auto_adjust_ff_dim=True,
    block_ffn_dim_multiplier=1.0, block_multiple_of=256, conv_L_cache=3, norm_eps=1e-5,
    layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    max_position_embeddings=128000, tie_word_embeddings=True,
)
#: a few layers of the same width (one conv, one attention): the smoke runs
LFM2_QUICK: dict[str, Any] = dict(LFM2_350M, num_hidden_layers=2, vocab_size=4096,
                                  layer_types=["conv", "full_attention"])

#: a Granite-4.0-H-350M-like shape (the values of ibm-granite/granite-4.0-h-350m's config as a
#: published copy of it gives them): dense (num_local_experts 0: the shared SwiGLU MLP alone,
#: shared_intermediate_size 2048), 768 wide, 32 layers with attention at 10, 13, 17, 27 and
#: Mamba2 elsewhere (48 heads of 32 = 2 · 768, state 128, 1 group, conv 4, chunk 256), 12
#: attention heads of 64 with 4 KV heads and no position embedding ("nope"), the µP multipliers
#: (embedding 12, attention 1/64, logits scaling 3; residual left at transformers' 1.0),
#: 100352-token vocabulary, tied embeddings, initializer_range 0.1 (the published value; at
#: transformers' default 0.02 the 2-layer quick model repeats one token per stream)
GRANITE_H_350M: dict[str, Any] = dict(
    vocab_size=100352, hidden_size=768, num_hidden_layers=32, num_attention_heads=12,
    num_key_value_heads=4, intermediate_size=2048, shared_intermediate_size=2048,
    num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=48, mamba_d_head=32,
    mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256,
    mamba_conv_bias=True, mamba_proj_bias=False, position_embedding_type="nope",
    embedding_multiplier=12.0, attention_multiplier=0.015625, logits_scaling=3.0,
    layer_types=["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)],
    max_position_embeddings=32768, tie_word_embeddings=True, initializer_range=0.1,
)
GRANITE_H_QUICK: dict[str, Any] = dict(GRANITE_H_350M, num_hidden_layers=2, vocab_size=4096,
                                       layer_types=["mamba", "attention"])


def lfm2_dir(shape: dict[str, Any] = LFM2_350M, seed: int = 0) -> Path:
    """The random-weight LFM2 checkpoint of ``shape`` (transformers' ``Lfm2ForCausalLM``,
    seeded, ``save_pretrained``; word-level tokenizer.json; built on first use, then reused)."""
    return random_checkpoint_dir("lfm2", "Lfm2Config", "Lfm2ForCausalLM", shape, seed)


def granite_hybrid_dir(shape: dict[str, Any] = GRANITE_H_350M, seed: int = 0) -> Path:
    """The random-weight Granite-4.0-H checkpoint of ``shape`` (transformers'
    ``GraniteMoeHybridForCausalLM``, seeded, ``save_pretrained``; word-level tokenizer.json;
    built on first use, then reused)."""
    return random_checkpoint_dir("granite-h", "GraniteMoeHybridConfig",
                                 "GraniteMoeHybridForCausalLM", shape, seed)


#: the layer names of the published Granite-4.0-H config.json files, which the converter reads
GRANITE_LAYER_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def hybrid_llama_cpp_runner(model_dir: Path, src_arg: str | None, threads: int,
                            layer_names: dict[str, str] | None = None
                            ) -> tuple[LlamaCppRunner | None, str | None]:
    """``llama_cpp_runner`` for a hybrid checkpoint: converted with no vocabulary (``gguf_file``
    ``no_vocab``; ``layer_names`` as there), and a conversion or load failure is the column's
    note, not the run's end."""
    why = llama_cpp_missing()
    src = llama_cpp_src(src_arg)
    if why is None and src is None:
        why = ("llama.cpp column skipped: no convert_hf_to_gguf.py (pass --llama-cpp-src or set "
               "LLAMA_CPP_SRC to the sdist's vendor/llama.cpp folder)")
    if why is not None:
        return None, why
    try:
        gguf = gguf_file(model_dir, src, no_vocab=True, layer_names=layer_names)
    except RuntimeError as e:
        lines = [x for x in str(e).splitlines() if x.strip()]
        return None, f"llama.cpp column skipped: {lines[0]} {lines[-1] if len(lines) > 1 else ''}"
    try:
        return LlamaCppRunner(gguf, threads), None
    except RuntimeError as e:
        return None, f"llama.cpp column skipped: {e}"
