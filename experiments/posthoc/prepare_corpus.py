"""Build the token files of the post-hoc MC experiment from text already on disk.

No network: the text is the English help of programs installed on this machine, the Vim
reference manual (``/usr/share/vim/vim*/doc/*.txt``) and the CMake manual
(``/usr/share/cmake*/Help/**/*.rst``), tokenized with the shipped tokenizer
(``mcserve/assets/default_model/tokenizer.json``, 4096 tokens). Whole files go to the held-out
split by a hash of their name, so evaluation windows are long, coherent documents the model
never saw::

    python experiments/posthoc/prepare_corpus.py --out experiments/posthoc/data

Writes ``train.bin`` / ``valid.bin`` (uint16 ids, documents joined by ``<|eos|>``), the held-out
tokens split once more into ``eval.bin`` (the first 75 %, for ``mcserve eval``) and ``calib.bin``
(the rest, for ``mcserve eval calibrate-delta``, so the scales never see the evaluation text),
``valid.txt`` (the held-out text) and ``meta.json``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "mcserve/assets/default_model/tokenizer.json"
SOURCES = {
    "vim": "/usr/share/vim/vim*/doc/*.txt",
    "cmake": "/usr/share/cmake*/Help/**/*.rst",
}


def held_out(name: str, every: int) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % every == 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "experiments/posthoc/data"))
    ap.add_argument("--valid-every", type=int, default=12,
                    help="one file in N (by name hash) is held out")
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = tok.token_to_id("<|eos|>")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[int]] = {"train": [], "valid": []}
    valid_text: list[str] = []
    meta: dict = {"sources": {}, "tokenizer": str(TOKENIZER.relative_to(ROOT))}
    for source, pattern in SOURCES.items():
        files = sorted(glob.glob(pattern, recursive=True))
        meta["sources"][source] = {"pattern": pattern, "files": len(files)}
        for f in files:
            text = Path(f).read_text(encoding="utf-8", errors="replace")
            if len(text) < 200:
                continue
            split = "valid" if held_out(Path(f).name, args.valid_every) else "train"
            splits[split].extend(tok.encode(text, add_special_tokens=False).ids + [eos])
            if split == "valid":
                valid_text.append(text)
    for split, ids in splits.items():
        np.asarray(ids, dtype="<u2").tofile(out / f"{split}.bin")
        meta[f"{split}_tokens"] = len(ids)
    cut = len(splits["valid"]) * 3 // 4
    np.asarray(splits["valid"][:cut], dtype="<u2").tofile(out / "eval.bin")
    np.asarray(splits["valid"][cut:], dtype="<u2").tofile(out / "calib.bin")
    meta.update(eval_tokens=cut, calib_tokens=len(splits["valid"]) - cut)
    (out / "valid.txt").write_text("\n\n".join(valid_text), encoding="utf-8")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
