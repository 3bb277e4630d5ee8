"""MC ablations on MQAR (paper Table 5 and §3.3/§5.2, at small scale).

Every run is the MQAR setting of ``mqar.py`` (same task, same held-out sets, same training
recipe) on one memory family (default ``linear``), changing one design choice of ``grm``:

| run | what changes |
|---|---|
| ``grm`` | the reference: gates γ = softmax_i ⟨u_t, p_i⟩/√K, u_t = x_t·W_u, checkpoint mode |
| ``grm -context`` | γ from the input only: r_i = ⟨u_t, e_{s−i}⟩/√K, e a learned embedding |
|  | of the segment's distance s − i (clipped at 15) instead of its mean key p_i |
| ``grm -gating`` | = ``residual`` (γ ≡ 1) |
| ``grm u=q`` | ``share_uq``: u_t = q_t, no W_u |
| ``grm independent`` | ``mc_mode=independent``: every segment restarts from the initial memory |
| ``grm C=16/32/64/128`` | segment length |
| ``ssc`` (+ ``-context``) | the same for SSC, with ``--ssc`` |

``-context`` is not a variant of mcserve: it is a subclass of ``mcserve.models.mc.MCMemory``
defined here (``XOnlyGates``) that replaces the scores of the gate softmax and installs itself
in each mixer of a fresh ``MCForCausalLM`` (``spec["hook"]``); everything else (the memory scan,
the cached states, the aggregation) is mcserve's.

    python experiments/recall/ablations.py --quick      # smoke (< 3 min)
    python experiments/recall/ablations.py              # the ablation table of FINDINGS.md
    python experiments/recall/ablations.py --family dla --seg-lens 16 32 64 128 --ssc
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mqar import run_mqar  # noqa: E402
from recall_common import (  # noqa: E402
    env_info,
    env_line,
    print_table,
    results_path,
    run_many,
    write_json,
)

from mcserve.config import MEMORIES  # noqa: E402
from mcserve.models.mc import MCMemory  # noqa: E402
from mcserve.models.mc_state import MCLayerState  # noqa: E402

MAX_DIST = 16


class XOnlyGates(MCMemory):
    """GRM/SSC whose gate scores depend on the token only (through u_t) and on how far back a
    segment is, not on what the segment holds: r_i = ⟨u_t, e_{min(s−i, 15)}⟩/√K (online: e_0).
    """

    def __init__(self, family, cfg, emb: nn.Parameter):
        super().__init__(family, cfg)
        self.emb = emb  # (H, MAX_DIST, K), owned by the mixer
        self.chunked = False  # the one-pass chunk path scores by content: keep the _piece loop
        if cfg.variant not in ("grm", "ssc") or self.soup:
            raise ValueError("XOnlyGates supports grm and ssc on non-soup memories")

    def _piece(self, st: MCLayerState, q: Tensor, k: Tensor, v: Tensor, u: Tensor,
               gates: dict[str, Tensor]) -> Tensor:
        B, L, H, K = q.shape
        N = st.num_cached
        cum = st.seg_ksum[:, None] + k.cumsum(1)
        dist = (N - torch.arange(N + 1, device=q.device)).clamp(max=self.emb.shape[1] - 1)
        r = torch.einsum("blhk,hnk->blnh", u, self.emb[:, dist]) / math.sqrt(K)  # (B,L,N+1,H)
        r_c, r_on = r[:, :, :N], r[:, :, N]
        if self.cfg.variant == "ssc" and N > self.cfg.top_k:
            idx = self._select(r_c, self.cfg.top_k)
            gamma = torch.softmax(torch.cat([r_c.gather(2, idx), r_on[:, :, None]], 2), 2)
            w_c = q.new_zeros(B, L, N, H).scatter(2, idx, gamma[:, :, :-1])
        else:
            gamma = torch.softmax(r, 2)
            w_c = gamma[:, :, :-1]
        w_on = gamma[:, :, -1]
        o, st.mem = self.family.scan(st.mem, q, k, v, gates)
        y = o * w_on[..., None]
        if N:
            y = y + self.family.readout_mix(st.cached, q, w_c)
        st.seg_ksum = cum[:, -1]
        st.seg_len += L
        st.pos += L
        return y


def xonly_gates(model: nn.Module) -> None:
    """Hook for ``recall_common.build_model``: install ``XOnlyGates`` in every mixer."""
    for blk in model.layers:
        mx = blk.mixer
        mx.seg_emb = nn.Parameter(torch.randn(mx.H, MAX_DIST, mx.K) * 0.02)
        mx.memory = XOnlyGates(mx.family, mx.cfg.mc, mx.seg_emb)


_SAME = ("family", "variant", "mc", "d_model", "seq_len", "vocab", "train_pairs", "eval_pairs",
         "batch", "lr", "seed", "eval_n", "steps", "hook", "curriculum")


def reuse(specs: list[dict[str, Any]], src: str, jsonl: str, resume: bool) -> set[str]:
    """Copy finished mqar.py runs with identical settings into ``jsonl`` under the ablation's
    names; returns the names reused."""
    found = {}
    for line in Path(src).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "error" not in r:
                found[json.dumps([r["spec"].get(k) for k in _SAME], sort_keys=True)] = r
    names = set()
    mode = "a" if resume else "w"
    with open(jsonl, mode, encoding="utf-8") as f:
        for s in specs:
            r = found.get(json.dumps([s.get(k) for k in _SAME], sort_keys=True))
            if r is not None:
                f.write(json.dumps(dict(r, spec=s, reused_from=r["spec"]["name"])) + "\n")
                names.add(s["name"])
    print(f"reused from {src}: {sorted(names) or 'nothing'}")
    return names


def make_specs(a: argparse.Namespace) -> list[dict[str, Any]]:
    T = a.seq_len
    pairs = [p for p in a.pairs if 4 * p <= T and p < a.vocab // 2]
    base = dict(d_model=a.d_model, seq_len=T, vocab=a.vocab, train_pairs=pairs,
                eval_pairs=pairs, batch=a.batch, lr=a.lr, seed=a.seed, eval_n=a.eval_n,
                curriculum=a.curriculum,
                steps=a.steps, family=a.family,
                max_seconds=a.max_minutes * 60 if a.max_minutes else None)
    every = max(1, a.steps // 4)
    base["eval_at"] = [every, 2 * every, 3 * every]
    C = a.segment_len
    runs: list[tuple[str, str, dict[str, Any], str | None]] = [
        ("grm", "grm", {"segment_len": C}, None),
        ("grm -context", "grm", {"segment_len": C}, "ablations:xonly_gates"),
        ("grm -gating (residual)", "residual", {"segment_len": C}, None),
        ("grm u=q", "grm", {"segment_len": C, "share_uq": True}, None),
        ("grm independent", "grm", {"segment_len": C, "mc_mode": "independent"}, None),
    ]
    for c in a.seg_lens:
        if c != C:
            runs.append((f"grm C={c}", "grm", {"segment_len": c}, None))
    if a.ssc:
        runs += [("ssc", "ssc", {"segment_len": C, "mc_top_k": a.top_k}, None),
                 ("ssc -context", "ssc", {"segment_len": C, "mc_top_k": a.top_k},
                  "ablations:xonly_gates"),
                 ("ssc u=q", "ssc", {"segment_len": C, "mc_top_k": a.top_k,
                                     "share_uq": True}, None)]
    specs = []
    for label, v, mc, hook in runs:
        if a.family in ("dla", "titans"):
            mc.setdefault("inner_chunk", min(16, mc["segment_len"]))
        s = dict(base, name=f"abl/{a.family}/{label}/d{a.d_model}/T{T}/s{a.seed}", label=label,
                 variant=v, mc=mc)
        if hook:
            s["hook"] = hook
        specs.append(s)
    return specs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--family", default="linear", choices=MEMORIES)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--curriculum", type=float, default=0.4)
    ap.add_argument("--segment-len", type=int, default=16)
    ap.add_argument("--seg-lens", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--ssc", action="store_true", help="also the SSC rows")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=512)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only the specs whose name matches one of these globs")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--reuse", default=None,
                    help="mqar.py JSONL whose runs with the same settings are reused, not rerun "
                         "(e.g. grm and residual at the reference segment length)")
    ap.add_argument("--out", default=None, help="JSON path (default results/ablations.json)")
    a = ap.parse_args(argv)
    if a.quick:
        a.seq_len, a.pairs, a.steps, a.eval_n, a.segment_len = 64, [4], 60, 64, 16
        a.seg_lens = [16]
        a.out = a.out or "tmp_ablations_quick.json"
    out = a.out or "ablations.json"
    torch.set_num_threads(a.threads)
    specs = make_specs(a)
    if a.only:
        specs = [s for s in specs if any(fnmatch.fnmatchcase(s["name"], o) for o in a.only)]
    out_path = results_path(out)
    jsonl = a.jsonl or str(out_path.with_suffix(".jsonl"))
    env = env_info()
    print(env_line(env))
    t0 = time.perf_counter()
    reused = reuse(specs, a.reuse, jsonl, a.resume) if a.reuse else set()
    results = run_many(run_mqar, specs, jsonl, jobs=a.jobs, threads=a.threads,
                       resume=a.resume or bool(reused))
    wall = time.perf_counter() - t0
    rows = []
    pairs = specs[0]["eval_pairs"] if specs else []
    for r in results:
        if "error" in r:
            print(f"ERROR {r['spec']['name']}: {r['error']}")
            continue
        acc = r["eval"]["acc"]
        rows.append([r["spec"]["label"]] + [f"{100 * acc[str(p)]:.1f}" for p in pairs]
                    + [f"{100 * sum(acc.values()) / len(acc):.1f}", r["steps_done"], r["params"]])
    print_table(rows, ["run"] + [f"{p} pairs" for p in pairs] + ["mean", "steps", "params"],
                title=f"Ablations on MQAR ({a.family}, d_model {a.d_model}, T {a.seq_len}), "
                      "accuracy (%)")
    data = {"bench": "ablations", "env": env, "args": vars(a), "wall_s": round(wall, 1),
            "results": results}
    paths = write_json(data, out)
    print(f"\nwall {wall:.0f} s; wrote {', '.join(map(str, paths))}")
    return data


if __name__ == "__main__":
    main()
