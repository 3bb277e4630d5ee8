"""Memory of a served model by weight precision: float32, bf16, int8, against llama.cpp's GGUFs.

Each configuration runs in a fresh process that loads the model into an engine (one stream,
prefix caching off) and generates 8 greedy tokens of a 16-token prompt. Reported, in MB: the
resident memory (``VmRSS``) after loading and after generating; its peak (``VmHWM``, which counts
the checkpoint file's pages while they are mapped: page cache, dropped under pressure); the peak
of the process's own memory while the engine loads (``RssAnon``, sampled every 2 ms); the growth
over the process's start and its ratio to mcserve float32's; the bytes the model's parameters
hold (``lowp_linear.weight_precision``). The engine's state and KV pools are 16 MiB each
(``POOL_MIB``; 1 GiB each by default), so the figures are the weights and the runtime.

The configurations: mcserve float32 (with its default oneDNN-packed copies of the large linears,
and without: ``cpu_packed_weights=False``); bf16 and int8 as the engine runs them (the large
weights made compact as the checkpoint is read and only those kept, ``models/compact_weight.py``);
bf16 and int8 "kept" (loaded in float32, converted, the float32 weights kept beside the copies:
the baseline); llama.cpp F32 / F16 / Q8_0 on the same weights where their GGUFs exist
(``--llama-cpp-src`` converts them, as in ``offline.py``; llama.cpp maps the file, so its
resident weights are the pages a generation touched).

    python bench/weight_memory.py                 # Mamba2-130M shape, the default model, a MoE
    python bench/weight_memory.py --quick         # a 2-layer Mamba2 only (smoke)

Prints the table and writes ``bench/results/weight_memory.json`` (``--quick``:
``tmp_weight_memory_quick.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import baselines as bl  # noqa: E402
from common import env_info, env_line, print_table, set_threads, write_json  # noqa: E402

#: name → (EngineConfig fields, release the float32 weights)
MCSERVE = {"float32": ({}, True), "float32 unpacked": ({"cpu_packed_weights": False}, True),
           "bf16": ({"dtype": "bfloat16"}, True),
           "bf16 kept": ({"dtype": "bfloat16"}, False), "int8": ({"quantization": "int8"}, True),
           "int8 kept": ({"quantization": "int8"}, False)}
LLAMA = ("f32", "f16", "q8_0")
#: the engine's state and KV pools (MiB each; 1024 by default), small as llama.cpp's context here
POOL_MIB = 16


def _status() -> dict[str, float]:
    """This process's VmRSS, VmHWM and RssAnon in MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon"):
            out[key] = int(rest.split()[0]) / 1024
    return out


class _AnonPeak:
    """The largest ``RssAnon`` (MB) seen every 2 ms until ``stop``: the peak of the process's
    own memory, which ``VmHWM`` mixes with the pages of the checkpoint's mapped file (those are
    the page cache's, dropped under pressure)."""

    def __init__(self):
        import threading

        self.peak, self.done = 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, _status()["RssAnon"])

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return max(self.peak, _status()["RssAnon"])


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration, in this (fresh) process."""
    import torch

    torch.set_num_threads(spec["threads"])
    prompt = [bl.prompts(spec["vocab"], 1, 16)[0]]
    start = _status()
    if spec["engine"] == "llama.cpp":
        from llama_cpp_baseline import LlamaCppRunner

        runner = LlamaCppRunner(Path(spec["gguf"]), spec["threads"])
        loaded = _status()
        tokens = runner.run(prompt, 8, 1).outputs[0]
        return {"start": start, "loaded": loaded, "generated": _status(), "tokens": tokens}
    import mcserve.engine.llm_engine as le
    from mcserve.engine.llm import LLM
    from mcserve.engine.sampling import SamplingParams
    from mcserve.models.lowp_linear import prepare_cpu_weights, weight_precision

    kw, release = MCSERVE[spec["name"]]
    if not release:  # float32 loaded, converted, kept: the engine without the release
        le.load_compact = lambda *a: None
        le.prepare_cpu_weights = (lambda m, d, q: prepare_cpu_weights(m, d, q, release=False))
    sampler = _AnonPeak()
    llm = LLM(spec["model"], max_num_seqs=1, max_model_len=32, enable_prefix_caching=False,
              state_cache_mib=POOL_MIB, kv_cache_mib=POOL_MIB, **kw)
    loaded = dict(_status(), anon_peak=sampler.stop())
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)
    info = weight_precision(llm.engine.model)
    return {"start": start, "loaded": loaded, "generated": _status(),
            "tokens": list(out[0].outputs[0].token_ids), "held_bytes": info["held_bytes"],
            "float32_kept_bytes": info["float32_kept_bytes"]}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if x.strip()] or ["failed"]
        return {"error": lines[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def models(quick: bool) -> list[tuple[str, Path, int, dict[str, Any]]]:
    """(name, checkpoint, vocabulary, GGUF conversion options) of each model measured."""
    from mcserve.engine.llm_engine import DEFAULT_MODEL_DIR

    if quick:  # one model: each configuration is a process of its own, seconds each
        return [("Mamba2 2 layers of 768", bl.mamba2_dir(bl.MAMBA2_QUICK), 4096, {})]
    from moe import GRANITE_H_MOE, SEED

    return [("Mamba2-130M shape", bl.mamba2_dir(bl.MAMBA2_130M), 50288, {}),
            ("mcserve default model", DEFAULT_MODEL_DIR, 0, None),
            ("Granite-4.0-H MoE, 8 layers", bl.granite_hybrid_dir(GRANITE_H_MOE, seed=SEED),
             GRANITE_H_MOE["vocab_size"],
             {"no_vocab": True, "layer_names": bl.GRANITE_LAYER_NAMES})]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--llama-cpp-src", default=None)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return {}
    threads = set_threads(args.threads)
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    for title, path, vocab, convert in models(args.quick):
        if not vocab:
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        specs = [{"engine": "mcserve", "name": n, "model": str(path)} for n in MCSERVE]
        if convert is not None:
            why = bl.llama_cpp_missing()
            src = bl.llama_cpp_src(args.llama_cpp_src)
            for t in LLAMA:
                gguf = path.with_name(path.name + f"-{t}.gguf")
                if why is None and not gguf.is_file() and src is not None:
                    try:
                        gguf = bl.gguf_file(path, src, t, **convert)
                    except RuntimeError as e:
                        why = f"{title}: GGUF {t} not converted: {str(e).splitlines()[-1]}"
                if why is None and gguf.is_file():
                    specs.append({"engine": "llama.cpp", "name": f"llama.cpp {t.upper()}",
                                  "gguf": str(gguf)})
            if why:
                notes.append(why)
            elif len(specs) == len(MCSERVE):
                notes.append(f"{title}: llama.cpp skipped: no GGUFs beside {path} (pass "
                             "--llama-cpp-src to convert them)")
        for spec in specs:
            spec.update(threads=threads, vocab=vocab)
            res = run_child(spec)
            results.append({"model": title, "name": spec["name"], **res})
            print(f"  {title}, {spec['name']}: "
                  + (res["error"] if "error" in res else
                     f"{res['generated']['VmRSS'] - res['start']['VmRSS']:.0f} MB"), flush=True)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["name"], "error", "", "", "", "", "", ""])
            continue
        base = next(x for x in results if x["model"] == r["model"] and x["name"] == "float32")
        grown = r["generated"]["VmRSS"] - r["start"]["VmRSS"]
        base_grown = base["generated"]["VmRSS"] - base["start"]["VmRSS"]
        held = r.get("held_bytes")
        anon = r["loaded"].get("anon_peak")
        rows.append([r["model"], r["name"], f"{r['loaded']['VmRSS']:.0f}",
                     f"{r['generated']['VmRSS']:.0f}", f"{r['generated']['VmHWM']:.0f}",
                     "" if anon is None else f"{anon:.0f}", f"{grown:.0f}",
                     f"{grown / base_grown:.2f}x", "" if held is None else f"{held / 1e6:.0f}"])
    env = env_info()
    print(env_line(env))
    print("each configuration in a fresh process: loaded into an engine (1 stream), 8 greedy "
          "tokens of a 16-token prompt; MB: resident after loading and after generating, peak "
          "(VmHWM, with the checkpoint's mapped pages), peak of the process's own memory while "
          "loading (RssAnon, sampled), growth over the process's start and its ratio to mcserve "
          "float32's, bytes the parameters hold")
    print_table(rows, ["model", "weights", "loaded", "generated", "peak", "peak anon",
                       "growth", "/ float32", "parameters"],
                title="resident memory (MB) by weight precision")
    for note in notes:
        print(note)
    data = {"env": env, "args": vars(args), "threads": threads, "results": results,
            "notes": notes}
    write_json(data, "tmp_weight_memory_quick.json" if args.quick else "weight_memory.json",
               extra=args.out)
    return data


if __name__ == "__main__":
    main()
