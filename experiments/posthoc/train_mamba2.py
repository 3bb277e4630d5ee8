"""Train a small Mamba2 language model in the transformers format, without Memory Caching.

The model is transformers' ``Mamba2ForCausalLM`` (its ``Mamba2Config`` and its initialisation:
Δ drawn log-uniformly in [dt_min, dt_max] into ``dt_bias``, A = -[1, 16]). The training steps run
on mcserve's own Mamba2 forward (``mcserve.models.mamba2``, the serving code, whose logits equal
transformers' to float rounding) because on one CPU thread it is about twice as fast as
transformers' reference PyTorch path without the ``mamba_ssm`` kernels; the trained weights are
copied back into the transformers model, checked against it, and written with its
``save_pretrained``, so ``mcserve`` (and transformers) load the directory as any Mamba2 checkpoint::

    python experiments/posthoc/prepare_corpus.py
    python experiments/posthoc/train_mamba2.py            # writes experiments/posthoc/ckpt512

The defaults are the recipe of docs/post-hoc-mc.md: 2.8M parameters (d_model 256, 4 layers,
16 heads of 32, state 64), 512-token context, Δ initialised in [1e-3, 0.1] and A scaled by 0.001
(slow decay: the heads barely forget within the training length), 651 steps of 8 x 512 tokens.
The 128-token model of the same page: ``--out experiments/posthoc/ckpt --seq-len 128 --batch 32
--a-scale 0.01 --max-steps 428``.

AdamW, warmup + cosine, gradient clipping, fixed seed and data order (the batch of step s depends
on s and the seed alone). Without ``--max-minutes`` the schedule runs on steps and the run is
step-for-step reproducible; with it, on max(step / max_steps, elapsed / max_minutes), so a slow
shared machine anneals within the time budget. ``OUT/log.jsonl`` records every step;
``OUT/step{N}/`` holds intermediate checkpoints (``--save-every``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOKENIZER_DIR = ROOT / "mcserve/assets/default_model"


def hf_config(args: argparse.Namespace):
    from transformers import Mamba2Config

    d_inner = args.expand * args.d_model
    return Mamba2Config(
        vocab_size=args.vocab_size, hidden_size=args.d_model, num_hidden_layers=args.n_layers,
        state_size=args.state_size, expand=args.expand, head_dim=args.head_dim,
        num_heads=d_inner // args.head_dim, n_groups=1, conv_kernel=4, chunk_size=128,
        time_step_min=args.dt_min, time_step_max=args.dt_max, time_step_floor=1e-4,
        tie_word_embeddings=True, max_position_embeddings=args.seq_len,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )


def batch_at(tokens: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    """``(batch, seq_len + 1)`` windows at offsets drawn from (seed, step) alone."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int64))


def lr_at(step: int, progress: float, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def valid_nll(model, tokens: np.ndarray, seq_len: int, n: int = 16) -> float:
    x = torch.from_numpy(tokens[:n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1)
    logits, _ = model(x[:, :-1], None)
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


def save(model, hf_model, out: Path) -> None:
    """Copy the trained weights into the transformers model and write its directory."""
    state = {k: v.detach().clone() for k, v in model.hf_state_dict().items()}
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weight names differ: missing {missing}, unexpected {unexpected}")
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "experiments/posthoc/data"))
    ap.add_argument("--out", default=str(ROOT / "experiments/posthoc/ckpt512"))
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--state-size", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--dt-min", type=float, default=1e-3)
    ap.add_argument("--dt-max", type=float, default=1e-1)
    ap.add_argument("--a-scale", type=float, default=0.001,
                    help="multiply transformers' initial A (1..num_heads) by this: below 1 the "
                    "heads decay more slowly, so their states keep growing over the context")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=651)
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="time budget: the schedule anneals within it (default: none)")
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    from transformers import Mamba2ForCausalLM

    from mcserve.models.registry import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    data = Path(args.data)
    train = np.fromfile(data / "train.bin", dtype="<u2")
    valid = np.fromfile(data / "valid.bin", dtype="<u2")
    hf_model = Mamba2ForCausalLM(hf_config(args)).float().eval()
    if args.a_scale != 1.0:  # A = -exp(A_log)
        with torch.no_grad():
            for layer in hf_model.backbone.layers:
                layer.mixer.A_log += math.log(args.a_scale)
    with tempfile.TemporaryDirectory() as tmp:  # transformers' init, read by mcserve's importer
        hf_model.save_pretrained(tmp)
        model = load_model(tmp, dtype="float32")
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"params {n_params / 1e6:.2f}M, train {len(train)} tokens, config "
          f"{json.dumps(vars(args))}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    log = (out / "log.jsonl").open("w", encoding="utf-8")
    t0 = time.perf_counter()
    step = 0
    while step < args.max_steps:
        elapsed = time.perf_counter() - t0
        progress = step / args.max_steps
        if args.max_minutes:
            progress = max(progress, elapsed / (60 * args.max_minutes))
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_at(train, step, args.batch, args.seq_len, args.seed)
        logits, _ = model(x[:, :-1], None)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        step += 1
        rec = {"step": step, "loss": round(loss.item(), 4), "lr": round(lr, 6),
               "gnorm": round(gnorm, 3), "s": round(time.perf_counter() - t0, 1)}
        if step % 50 == 0 or step == args.max_steps:
            model.eval()
            rec["valid_loss"] = round(valid_nll(model, valid, args.seq_len), 4)
            model.train()
            print(json.dumps(rec), flush=True)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if args.save_every and step % args.save_every == 0:
            save(model, hf_model, out / f"step{step}")
    model.eval()
    save(model, hf_model, out)
    # the directory must be the model that was trained: compare transformers' logits with ours
    x = torch.from_numpy(valid[:257].astype(np.int64))[None]
    with torch.no_grad():
        ours = model(x, None)[0]
        ref = Mamba2ForCausalLM.from_pretrained(out).float().eval()(x).logits
    rel = float((ours - ref).abs().max() / ref.abs().max())
    summary = {"steps": step, "seconds": round(time.perf_counter() - t0, 1),
               "params": n_params, "valid_loss": valid_nll(model, valid, args.seq_len),
               "hf_max_rel_diff": rel, "args": vars(args)}
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)
    if rel > 1e-3:
        sys.exit(f"transformers and mcserve disagree on the saved model (rel {rel:.2e})")


if __name__ == "__main__":
    main()
