"""llama.cpp for the baselines of ``baselines.py`` (``offline.py --compare``, ``serving.py
--compare``) and the llama-server column of ``multi_turn.py``: whether llama-cpp-python imports
(``llama_cpp_missing``), the llama.cpp source folder (``llama_cpp_src``: ``--llama-cpp-src`` or
``$LLAMA_CPP_SRC``), a checkpoint converted to GGUF with its ``convert_hf_to_gguf.py``
(``gguf_file``), and llama.cpp's own batched decode through llama-cpp-python's low-level API
(``LlamaCppRunner``). Set-up: ``baselines.py``'s docstring and bench/README.md.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baselines import Result


def llama_cpp_missing() -> str | None:
    """None when llama-cpp-python imports, else why not (shown instead of the column)."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # not installed, or its shared library failed to load
        return (f"llama.cpp column skipped: llama-cpp-python is not importable ({e}); "
                "see bench/README.md for the build")
    return None


def llama_cpp_src(arg: str | None) -> Path | None:
    src = arg or os.environ.get("LLAMA_CPP_SRC")
    if src and (Path(src) / "convert_hf_to_gguf.py").is_file():
        return Path(src)
    return None


#: runs convert_hf_to_gguf.py (argv[1]: the llama.cpp folder, the rest its arguments) with every
#: vocabulary writer of the converter replaced by llama.cpp's "no vocabulary" form (tokenizer
#: model ``none`` and ``vocab_size`` dummy tokens): for architectures whose converter insists on
#: a tokenizer the random checkpoints do not have (LFM2 needs a recognised BPE tokenizer; the
#: built-in GPT-NeoX fallback of Mamba2 / Granite-H has 50k tokens, fewer than Granite's 100k)
_CONVERT_NO_VOCAB = """
import runpy, sys
from pathlib import Path
src = Path(sys.argv[1])
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion.base import TextModel
def no_vocab(self, *args, **kwargs):
    self.gguf_writer.add_tokenizer_model("none")
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
for name in ("_set_vocab_gpt2", "_set_vocab_sentencepiece", "_set_vocab_builtin",
             "_set_vocab_llama_hf", "_set_vocab_qwen"):
    if hasattr(TextModel, name):
        setattr(TextModel, name, no_vocab)
sys.argv = [str(src / "convert_hf_to_gguf.py"), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_file(model_dir: Path, src: Path, outtype: str = "f32", no_vocab: bool = False,
              layer_names: dict[str, str] | None = None) -> Path:
    """``model_dir`` converted to a GGUF of ``outtype`` (``f32``, ``f16``, ``q8_0``: the
    converter's own quantization) cached beside it; no tokenizer is written. ``no_vocab``: the
    GGUF says "no vocabulary" (``_CONVERT_NO_VOCAB``) instead of the converter's own fallback;
    the benchmarks feed token ids, so nothing reads it. ``layer_names``: config.json's
    ``layer_types`` renamed so for the converter (transformers 5 saves Granite-H's ``mamba`` /
    ``attention`` as ``linear_attention`` / ``full_attention``, which the converter does not
    read)."""
    out = model_dir.with_name(model_dir.name + f"-{outtype}.gguf")
    if out.is_file():
        return out
    bare = model_dir.with_name(model_dir.name + "-notok")
    shutil.rmtree(bare, ignore_errors=True)
    bare.mkdir()
    for f in model_dir.iterdir():
        if f.name == "config.json" and layer_names:
            cfg = json.loads(f.read_text())
            cfg["layer_types"] = [layer_names.get(t, t) for t in cfg["layer_types"]]
            (bare / f.name).write_text(json.dumps(cfg, indent=2))
        elif f.name != "tokenizer.json":
            os.link(f, bare / f.name)
    convert = ([sys.executable, "-c", _CONVERT_NO_VOCAB, str(src)] if no_vocab
               else [sys.executable, str(src / "convert_hf_to_gguf.py")])
    cmd = [*convert, str(bare), "--outtype", outtype, "--outfile", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    shutil.rmtree(bare, ignore_errors=True)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return out


class LlamaCppRunner:
    """llama.cpp's own batched decode: one ``llama_decode`` per step with one token of every
    stream (``n_seq_max`` = streams, one recurrent state per sequence), greedy on the logits."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, name: str | None = None):
        import llama_cpp as L

        self.L, self.threads = L, threads
        self.name = name or self.name
        L.llama_backend_init()
        # keep the callback referenced: llama.cpp calls it from C for as long as it runs
        self._quiet = L.llama_log_callback(lambda *a: None)
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def system_info(self) -> str:
        """llama.cpp's own account of its build: the instruction sets its CPU backend uses
        (``AVX2 = 1``, ``AVX512 = 0``, ...), the path it was loaded from."""
        info = self.L.llama_print_system_info()
        text = info.decode() if isinstance(info, bytes) else str(info)
        return f"{' '.join(text.split())} [{Path(self.L.__file__).parent}]"

    def _context(self, streams: int, max_len: int, n_batch: int):
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = streams * max_len
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = streams
        cp.n_threads = cp.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def _generate(self, ctx, ids: list[list[int]], new_tokens: int) -> list[list[int]]:
        import numpy as np

        L = self.L
        streams, plen = len(ids), len(ids[0])
        batch = L.llama_batch_init(max(streams * plen, streams), 0, streams)
        try:
            def fill(entries):  # (token, pos, seq, wants_logits)
                for i, (tok, pos, seq, lg) in enumerate(entries):
                    batch.token[i], batch.pos[i] = tok, pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = lg
                batch.n_tokens = len(entries)
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")

            fill([(t, p, s, p == plen - 1) for s in range(streams)
                  for p, t in enumerate(ids[s])])
            rows = [s * plen + plen - 1 for s in range(streams)]
            out: list[list[int]] = [[] for _ in range(streams)]
            for step in range(new_tokens):
                nxt = []
                for s, row in enumerate(rows):
                    lg = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row),
                                               shape=(self.n_vocab,))
                    nxt.append(int(lg.argmax()))
                    out[s].append(nxt[-1])
                if step == new_tokens - 1:
                    break
                fill([(nxt[s], plen + step, s, True) for s in range(streams)])
                rows = list(range(streams))
            return out
        finally:
            L.llama_batch_free(batch)

    def run(self, ids: list[list[int]], new_tokens: int, repeats: int) -> Result:
        from baselines import Result  # here, not at the top: baselines imports this module

        L = self.L
        streams = len(ids)
        ctx = self._context(streams, len(ids[0]) + new_tokens + 1, max(512, streams * len(ids[0])))
        try:
            mem = L.llama_get_memory(ctx)
            L.llama_memory_clear(mem, True)
            self._generate(ctx, [ids[0][:4]] * streams, 2)  # warm up
            secs = []
            for _ in range(repeats):
                L.llama_memory_clear(mem, True)
                t0 = time.perf_counter()
                out = self._generate(ctx, ids, new_tokens)
                secs.append(time.perf_counter() - t0)
                assert all(len(o) == new_tokens for o in out)
        finally:
            L.llama_free(ctx)
        return Result(self.name, streams, streams * new_tokens, secs, out)
