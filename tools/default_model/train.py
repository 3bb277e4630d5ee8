"""Train the embedded default model (a small MC language model) from scratch on CPU.

Uses the model's own parallel forward (the code that serves), AdamW with a cosine schedule and
warmup, gradient clipping, a fixed seed and a deterministic data order. Checkpoints every
``--ckpt-every`` steps into ``OUT/ckpt.pt`` and resumes from it with ``--resume``. At the end it
measures held-out perplexity and passkey accuracy by length (greedy; with the model's MC and with
``mc_variant="none"`` on the same weights), writes ``OUT/results.json`` and saves the model with
its tokenizer into ``OUT/final``::

    python tools/default_model/prepare_data.py --out .data/data
    python tools/default_model/train.py --data .data/data --out .data/run --threads 1 \\
        --max-minutes 70

``--max-minutes`` is the training-time budget (evaluation comes after it). Without
``--max-steps`` the cosine schedule runs on the fraction of that budget spent (the machine is
shared, so its speed varies and a step count fixed in advance would either stop early or cut the
schedule); with ``--max-steps N`` it runs on steps, step for step reproducible. The data order
depends only on the step and the seed in both cases; results.json records the learning rate of
every step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from prepare_data import STANDARD_FILLER, passkey_prompt  # noqa: E402

from mcserve.config import ModelConfig  # noqa: E402
from mcserve.models.native import MCForCausalLM  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


# --------------------------------------------------------------------------- data


class Batches:
    """Deterministic batches of (seq_len + 1)-token windows of ``train.bin``.

    The windows are the non-overlapping chunks of the token stream (consecutive chunks share one
    token); each epoch visits all of them in an order drawn from ``seed + epoch``, so the batch of
    step ``s`` depends on ``s`` alone, which is what makes ``--resume`` exact.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, seed: int):
        self.tokens, self.seq_len, self.batch, self.seed = tokens, seq_len, batch, seed
        self.n_chunks = (len(tokens) - 1) // seq_len
        self._perm_epoch, self._perm = -1, None

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng(self.seed + epoch).permutation(self.n_chunks)
            self._perm_epoch = epoch
        return self._perm

    def get(self, step: int) -> torch.Tensor:
        rows = []
        for j in range(step * self.batch, (step + 1) * self.batch):
            epoch, k = divmod(j, self.n_chunks)
            c = int(self._order(epoch)[k])
            rows.append(self.tokens[c * self.seq_len: c * self.seq_len + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))


def lr_at(step: int, progress: float, warmup: int, peak: float, min_ratio: float) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from ``peak`` to ``min_ratio * peak`` as
    ``progress`` goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def lm_loss(model: MCForCausalLM, x: torch.Tensor) -> torch.Tensor:
    logits, _ = model(x[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def perplexity(model: MCForCausalLM, tokens: np.ndarray, seq_len: int, batch: int = 8
               ) -> tuple[float, int]:
    """exp(mean NLL) over non-overlapping windows of seq_len + 1 tokens, each from a fresh state."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = [tokens[c * seq_len: c * seq_len + seq_len + 1] for c in range(i, min(n, i + batch))]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        logits, _ = model(x[:, :-1])
        nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                              reduction="sum")
        total += float(nll)
        count += x[:, 1:].numel()
    return math.exp(total / count), count


def passkey_ids(tok, length: int, passkey: str, depth: float, bos: int) -> list[int]:
    """Token ids of a passkey prompt of about ``length`` tokens (standard filler), ending with
    'What is the passkey?'; the passkey sits at ``depth`` (0 = start, 1 = end) of the filler."""
    sentences = [s.strip() + "." for s in STANDARD_FILLER.split(".") if s.strip()]

    def build(n_sent: int) -> list[int]:
        filler = [sentences[i % len(sentences)] for i in range(n_sent)]
        cut = round(depth * n_sent)
        text = passkey_prompt(passkey, " ".join(filler[:cut]), " ".join(filler[cut:]))
        return [bos, *tok.encode(text, add_special_tokens=False).ids]

    per_sent = len(build(40)) - len(build(20))
    n = max(0, 20 + (length - len(build(20))) * 20 // max(1, per_sent))
    while n > 0 and len(build(n)) > length:
        n -= 1
    return build(n)


@torch.no_grad()
def passkey_eval(model: MCForCausalLM, tok, lengths: list[int], samples: int, seed: int,
                 bos: int) -> dict:
    model.eval()
    out = {}
    for length in lengths:
        rng = random.Random(seed * 1000 + length)
        correct, real = 0, []
        for i in range(samples):
            key = str(rng.randint(10000, 99999))
            depth = (i + 0.5) / samples  # evenly spread depths
            ids = passkey_ids(tok, length, key, depth, bos)
            real.append(len(ids))
            gen = model.generate(ids, max_new_tokens=8)
            digits = re.findall(r"\d+", tok.decode(gen))
            correct += bool(digits) and digits[0] == key
        out[str(length)] = {"accuracy": correct / samples, "correct": correct, "n": samples,
                            "mean_prompt_tokens": round(sum(real) / len(real), 1)}
    return out


def variant_model(model: MCForCausalLM, **changes) -> MCForCausalLM:
    """The same weights under another config (extra parameters such as u_proj are dropped)."""
    other = MCForCausalLM(model.config.replace(**changes))
    missing, _ = other.load_state_dict(model.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"weights missing for the variant: {missing}")
    return other.eval()


def evaluate(model: MCForCausalLM, tok, data: Path, args) -> dict:
    t0 = time.time()
    valid = np.fromfile(data / "valid.bin", dtype=np.uint16)
    ppl, n_tok = perplexity(model, valid, args.seq_len)
    res = {"valid_perplexity": round(ppl, 3), "valid_tokens_scored": n_tok}
    vs_file = data / "valid_synthetic.bin"
    if vs_file.exists():
        vs = np.fromfile(vs_file, dtype=np.uint16)
        res["valid_synthetic_perplexity"] = round(perplexity(model, vs, args.seq_len)[0], 3)
    print(f"held-out perplexity {ppl:.3f} over {n_tok} tokens", flush=True)
    bos = tok.token_to_id("<|bos|>")
    table = {}
    for name, m in (("mc_" + model.config.mc_variant, model),
                    ("none", variant_model(model, mc_variant="none"))):
        table[name] = passkey_eval(m, tok, args.passkey_lengths, args.passkey_samples,
                                   args.seed, bos)
    res["passkey"] = table
    lines = ["| length | " + " | ".join(table) + " |", "|---" * (len(table) + 1) + "|"]
    for length in map(str, args.passkey_lengths):
        lines.append(f"| {length} | " + " | ".join(
            f"{table[k][length]['correct']}/{table[k][length]['n']} "
            f"({100 * table[k][length]['accuracy']:.0f}%)" for k in table) + " |")
    res["passkey_table_md"] = "\n".join(lines)
    print("passkey accuracy (greedy, standard filler):\n" + res["passkey_table_md"], flush=True)
    prompt = "It is a truth universally acknowledged, that"
    gen = model.generate([bos, *tok.encode(prompt).ids], max_new_tokens=40)
    res["sample"] = prompt + tok.decode(gen)
    print("sample:", res["sample"], flush=True)
    res["eval_seconds"] = round(time.time() - t0, 1)
    return res


# --------------------------------------------------------------------------- main


def build_config(args, vocab: int, bos: int, eos: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        head_dim=args.head_dim, memory="linear", mc_variant="grm", mc_mode="checkpoint",
        segment_len=64, mc_top_k=2, max_position_embeddings=args.seq_len,
        bos_token_id=bos, eos_token_id=eos,
    )


def save_ckpt(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=".data/data")
    ap.add_argument("--out", default=".data/run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=70.0, help="training-time budget")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="total optimizer steps (default: from the budget and measured speed)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--passkey-lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--passkey-samples", type=int, default=20)
    ap.add_argument("--eval-only", metavar="MODEL_DIR", default=None,
                    help="only evaluate a saved model directory")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))

    if args.eval_only:
        model = MCForCausalLM.from_pretrained(args.eval_only)
        res = evaluate(model, tok, data, args)
        (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
        return

    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|eos|>")
    cfg = build_config(args, tok.get_vocab_size(), bos, eos)
    model = MCForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    tokens = np.fromfile(data / "train.bin", dtype=np.uint16)
    batches = Batches(tokens, args.seq_len, args.batch, args.seed)
    step, elapsed, total_steps, history = 0, 0.0, args.max_steps, []
    ckpt = out / "ckpt.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        total_steps = args.max_steps
        print(f"resumed from {ckpt} at step {step} ({elapsed / 60:.1f} min trained)", flush=True)
    tok_per_step = args.batch * args.seq_len
    print(f"config: {json.dumps(cfg.to_dict())}", flush=True)
    print(f"parameters: {n_params:,}; train tokens {len(tokens):,} "
          f"({batches.n_chunks} windows of {args.seq_len}); threads {torch.get_num_threads()}",
          flush=True)

    budget = args.max_minutes * 60
    bar = tqdm(total=total_steps, initial=step, dynamic_ncols=True, mininterval=5,
               desc="train", file=sys.stdout)
    model.train()
    run_start, run_steps, ema = time.time(), 0, None
    stop_reason = "max_steps"
    while total_steps is None or step < total_steps:
        if elapsed >= budget:
            stop_reason = "time budget"
            break
        t0 = time.time()
        if total_steps is not None:
            progress = (step - args.warmup) / max(1, total_steps - args.warmup)
        else:  # cosine over the part of the time budget left after warmup
            warm_sec = history[args.warmup - 1]["elapsed"] if step >= args.warmup else 0.0
            progress = (elapsed - warm_sec) / max(1.0, budget - warm_sec)
        lr = lr_at(step, progress, args.warmup, args.lr, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = lm_loss(model, batches.get(step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip))
        opt.step()
        dt = time.time() - t0
        elapsed += dt
        step += 1
        run_steps += 1
        lval = loss.item()
        ema = lval if ema is None else 0.95 * ema + 0.05 * lval
        history.append({"step": step, "loss": round(lval, 4), "lr": lr, "gnorm": round(gnorm, 3),
                        "sec": round(dt, 3), "elapsed": round(elapsed, 2)})
        tps = tok_per_step * run_steps / (time.time() - run_start)
        bar.set_postfix(loss=f"{ema:.3f}", tok_s=f"{tps:.0f}", lr=f"{lr:.2e}", refresh=False)
        bar.update(1)
        if step % args.log_every == 0:
            tqdm.write(f"step {step}/{total_steps} loss {lval:.4f} (ema {ema:.4f}) lr {lr:.2e} "
                       f"gnorm {gnorm:.2f} tok/s {tps:.0f} tokens {step * tok_per_step:,} "
                       f"elapsed {elapsed / 60:.1f} min", file=sys.stdout)
        if step % args.ckpt_every == 0 or (total_steps is not None and step == total_steps):
            save_ckpt(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                             "step": step, "elapsed": elapsed, "total_steps": total_steps,
                             "history": history, "config": cfg.to_dict(), "args": vars(args)})
    bar.close()
    save_ckpt(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "elapsed": elapsed, "total_steps": total_steps, "history": history,
                     "config": cfg.to_dict(), "args": vars(args)})
    last = history[-50:]
    train_loss = sum(h["loss"] for h in last) / max(1, len(last))
    print(f"stopped at step {step} ({stop_reason}); mean loss of the last {len(last)} steps "
          f"{train_loss:.4f}; {elapsed / 60:.1f} min", flush=True)

    final = out / "final"
    files = {name: (data / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES}
    model.eval()
    model.save_pretrained(final, tokenizer_files=files)
    reloaded = MCForCausalLM.from_pretrained(final)
    res = evaluate(reloaded, tok, data, args)
    res.update({
        "config": cfg.to_dict(),
        "parameters": n_params,
        "steps": step,
        "total_steps": total_steps,
        "stop_reason": stop_reason,
        "tokens_seen": step * tok_per_step,
        "epochs": round(step * args.batch / batches.n_chunks, 3),
        "train_seconds": round(elapsed, 1),
        "lr_schedule": "steps" if args.max_steps else "time budget",
        "tokens_per_second": round(step * tok_per_step / elapsed, 1) if elapsed else None,
        "final_train_loss_mean_last_50": round(train_loss, 4),
        "final_train_loss_last_step": history[-1]["loss"] if history else None,
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "loss_curve": [{"step": h["step"], "loss": h["loss"]} for h in history
                       if h["step"] % args.log_every == 0],
    })
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out / 'results.json'} and {final}", flush=True)


if __name__ == "__main__":
    main()
