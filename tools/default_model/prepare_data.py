"""Prepare the training data and tokenizer of the embedded default model.

Fetches an English corpus from Debian packages (with ``apt-get download``; no other network
access), cleans it into plain text, adds seeded synthetic recall data (key-value lists and
passkey-in-filler) and chat-formatted examples, trains a byte-level BPE tokenizer and writes
token files with train/valid splits::

    python tools/default_model/prepare_data.py --out .data/data

Sources (licences are copied into ``OUT/licenses/`` and listed in ``OUT/meta.json``):

* ``r-cran-janeaustenr``: Jane Austen's six novels (the texts are in the public domain; the
  R package is MIT). The text lives in an R lazy-load database, read here by a small R
  unserialiser.
* ``jargon-text``: the Jargon File 4.4.7 (public domain).
* ``python3.11-doc``: the Python 3.11 documentation sources, reStructuredText cleaned to plain
  text (PSF licence). Capped by ``--python-chars`` so that prose stays the majority.

Outputs in ``OUT``: ``tokenizer.json``, ``tokenizer_config.json`` (with a Jinja
``chat_template``), ``train.bin`` / ``valid.bin`` (uint16 token ids, documents wrapped in
``<|bos|> ... <|eos|>``; ``valid.bin`` holds held-out natural text only, for perplexity),
``valid_synthetic.bin``, ``train.txt`` / ``valid.txt`` samples and ``meta.json``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
BOS, EOS = "<|bos|>", "<|eos|>"
# Hugging Face chat template: every turn is "<|role|>\n{content}<|eos|>\n"; the model ends its
# answer with <|eos|>, which is the stop token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

PACKAGES = {
    "austen": "r-cran-janeaustenr",
    "jargon": "jargon-text",
    "python_docs": "python3.11-doc",
}
LICENCES = {
    "austen": "Jane Austen's novels (1811-1818): public domain; R package janeaustenr: MIT "
              "(c) 2016-2017 Julia Silge",
    "jargon": "The Jargon File 4.4.7 (Eric S. Raymond et al.): public domain",
    "python_docs": "Python 3.11 documentation: PSF License Agreement (c) Python Software "
                   "Foundation",
}

STANDARD_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
                   "Here we go. There and back again. ")
KEYS = (
    "apple pear plum grape lemon melon cherry peach mango olive onion carrot potato tomato "
    "garlic pepper rice bread cheese butter honey sugar salt coffee tea milk water wine "
    "river lake ocean island forest desert valley mountain hill meadow garden field road "
    "bridge tower castle church house cottage village city market harbour station school "
    "table chair window door mirror candle lamp clock book letter pencil paper ribbon "
    "bonnet glove shawl carriage horse dog cat bird fish fox wolf bear deer rabbit owl "
    "swan eagle robin sparrow lion tiger zebra camel whale shark crab snail bee ant "
    "red blue green yellow purple orange silver golden copper iron stone glass wood "
    "alpha beta gamma delta omega north south east west spring summer autumn winter "
    "morning evening night moon star cloud rain snow wind storm thunder fire ice"
).split()


# --------------------------------------------------------------------------- fetching


def fetch(work: Path) -> dict[str, dict]:
    """apt-get download + dpkg-deb -x the source packages; returns version and paths."""
    debs, root = work / "debs", work / "extract"
    debs.mkdir(parents=True, exist_ok=True)
    info = {}
    for source, pkg in PACKAGES.items():
        found = sorted(debs.glob(f"{pkg}_*.deb"))
        if not found:
            print(f"apt-get download {pkg}", flush=True)
            try:
                subprocess.run(["apt-get", "download", pkg], cwd=debs, check=True,
                               stdout=subprocess.DEVNULL)
            except (OSError, subprocess.CalledProcessError) as e:
                sys.exit(f"cannot download Debian package {pkg} ({e}); run `apt-get update` "
                         f"first, or put the .deb into {debs}")
            found = sorted(debs.glob(f"{pkg}_*.deb"))
        deb = found[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        version = subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], check=True,
                                 capture_output=True, text=True).stdout.strip()
        info[source] = {"package": pkg, "version": version, "deb": deb.name,
                        "copyright": str(root / "usr/share/doc" / pkg / "copyright"),
                        "licence": LICENCES[source]}
    return info


# --------------------------------------------------------------------------- Jane Austen


class _RReader:
    """Minimal reader of R's XDR serialisation: enough for character vectors and lists."""

    def __init__(self, data: bytes):
        self.b, self.i = data, 0
        self.refs: list = []

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.i)
        self.i += 4
        return v

    def read(self):
        if self.b[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.i = 2
        version = self._int()
        self._int()
        self._int()
        if version == 3:
            n = self._int()  # length of the native encoding name, which is skipped
            self.i += n
        return self._item()

    def _item(self):
        flags = self._int()
        t, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if t == 254:  # NILVALUE
            return None
        if t in (253, 252, 251, 250, 242, 241):
            return ("special", t)
        if t == 255:  # REFSXP
            return self.refs[(flags >> 8) - 1]
        if t == 1:  # SYMSXP
            sym = ("sym", self._item())
            self.refs.append(sym)
            return sym
        if t in (2, 6, 239, 240):  # pairlists
            if has_attr:
                self._item()
            tag = self._item() if has_tag else None
            car = self._item()
            cdr = self._item()
            return [(tag, car)] + (cdr if isinstance(cdr, list) else [])
        if t == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None
            s = self.b[self.i:self.i + n].decode("utf-8", "replace")
            self.i += n
            return s
        if t in (10, 13, 14, 16, 19, 20, 24):
            n = self._int()
            if n == -1:
                n = (self._int() << 32) + self._int()
            if t in (10, 13):
                v = list(struct.unpack_from(f">{n}i", self.b, self.i))
                self.i += 4 * n
            elif t == 14:
                v = list(struct.unpack_from(f">{n}d", self.b, self.i))
                self.i += 8 * n
            elif t == 24:
                v = self.b[self.i:self.i + n]
                self.i += n
            else:
                v = [self._item() for _ in range(n)]
            attr = self._item() if has_attr else None
            return ("vec", t, v, attr)
        raise ValueError(f"unsupported R SEXP type {t}")


def _r_names(attr) -> list[str]:
    for tag, val in attr or []:
        if tag == ("sym", "names"):
            return val[2]
    return []


def read_austen(root: Path) -> dict[str, list[str]]:
    """The novels as lists of lines, from the package's lazy-load data base."""
    d = root / "usr/lib/R/site-library/janeaustenr/data"
    index = _RReader(gzip.decompress((d / "Rdata.rdx").read_bytes())).read()
    top = dict(zip(_r_names(index[3]), index[2]))
    variables = top["variables"]
    rdb = (d / "Rdata.rdb").read_bytes()
    books = {}
    for name, entry in zip(_r_names(variables[3]), variables[2]):
        off, ln = entry[2]
        blob = rdb[off:off + ln]
        obj = _RReader(zlib.decompress(blob[4:])).read()
        books[name] = [s or "" for s in obj[2]]
    return books


def austen_docs(books: dict[str, list[str]]) -> list[str]:
    """One document per chapter; lines joined into paragraphs, _italics_ markers dropped."""
    docs = []
    chapter_re = re.compile(r"^(CHAPTER|Chapter)\s+[0-9IVXLC]+\.?\s*$")
    for name in sorted(books):
        paras, cur, chapters = [], [], []
        for line in books[name] + [""]:
            line = line.strip()
            if chapter_re.match(line):
                if cur:
                    paras.append(" ".join(cur))
                    cur = []
                if paras:
                    chapters.append(paras)
                paras = [line]
            elif line:
                cur.append(line)
            elif cur:
                paras.append(" ".join(cur))
                cur = []
        if paras:
            chapters.append(paras)
        for ch in chapters:
            text = "\n\n".join(ch).replace("_", "")
            text = re.sub(r"[ \t]+", " ", text)
            if len(text) > 200:
                docs.append(text)
    return docs


# --------------------------------------------------------------------------- Jargon File


def jargon_entries(root: Path) -> list[tuple[str, str, str]]:
    """(term, pronunciation/part of speech, definition) of the lexicon entries."""
    raw = gzip.decompress((root / "usr/share/doc/jargon-text/jargon.txt.gz").read_bytes())
    lines = raw.decode("utf-8", "replace").splitlines()
    head = re.compile(r"^   :(.+?):\s*(.*)$")
    entries, term, pos, body = [], None, "", []

    def flush():
        if term is None:
            return
        text = "\n".join(body).strip()
        paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
        text = "\n\n".join(p for p in paras if p)
        text = re.sub(r"\{([^{}]*)\}", r"\1", text)
        if len(text) > 20:
            entries.append((term, pos, text))

    for line in lines:
        m = head.match(line)
        if m:
            flush()
            term, pos, body = m.group(1).strip(), m.group(2).strip(), []
        elif term is not None:
            if re.match(r"^\S", line):  # a top-level heading ends the lexicon part
                flush()
                term, body = None, []
            else:
                body.append(line)
    flush()
    return entries


def jargon_docs(entries: list[tuple[str, str, str]], per_doc: int = 12) -> list[str]:
    docs = []
    for i in range(0, len(entries), per_doc):
        docs.append("\n\n".join(f"{t}: {p}\n{d}".replace(": \n", ":\n")
                                  for t, p, d in entries[i:i + per_doc]))
    return docs


# --------------------------------------------------------------------------- Python docs

_SIG_DIRECTIVES = {"function", "method", "class", "attribute", "data", "exception",
                   "decorator", "classmethod", "staticmethod", "module", "opcode",
                   "cmdoption", "option", "envvar", "describe", "coroutinefunction",
                   "coroutinemethod", "abstractmethod", "decoratormethod", "pdbcommand",
                   "c:function", "c:type", "c:macro", "c:member", "c:var"}
_KEEP_BLOCK = {"note", "warning", "versionadded", "versionchanged", "deprecated", "seealso",
               "code-block", "sourcecode", "doctest", "testcode", "impl-detail", "tip",
               "important", "attention", "caution", "hint", "admonition", "topic",
               "productionlist", "testoutput", "code"}
_TITLED = {"note": "Note", "warning": "Warning", "versionadded": "New in version",
           "versionchanged": "Changed in version", "deprecated": "Deprecated since version",
           "seealso": "See also", "tip": "Tip", "important": "Important"}


def _role(m: re.Match) -> str:
    text = m.group(2)
    t = re.match(r"^(.*?)\s*<[^<>]+>$", text)
    if t and t.group(1):
        text = t.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):
        text = text[1:].split(".")[-1]
    return f"`{text}`" if m.group(1) in ("func", "meth", "class", "mod", "attr", "data",
                                          "exc", "keyword", "const", "obj", "option",
                                          "envvar", "file", "program", "c:func") else text


def clean_rst(src: str) -> str:
    out: list[str] = []
    lines = src.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$", line)
        if m or re.match(r"^\s*\.\.(\s|$)", line):
            indent = len(m.group(1)) if m else len(line) - len(line.lstrip())
            name, arg = (m.group(2), m.group(3)) if m else ("", "")
            j = i + 1
            block = []
            while j < len(lines) and (not lines[j].strip() or
                                      len(lines[j]) - len(lines[j].lstrip()) > indent):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            body = [b for b in block if not re.match(r"^\s*:[\w-]+:", b)]
            if name in _SIG_DIRECTIVES:
                out.append(arg)
                out.extend(body)
            elif name in _KEEP_BLOCK:
                title = _TITLED.get(name)
                if title:
                    out.append(f"{title} {arg}".strip() + ("" if arg else ":"))
                out.extend(body)
            i = j
            continue
        if re.match(r"^([=\-~^*#+\"'`.:_])\1{3,}\s*$", line):  # heading under/overline
            i += 1
            continue
        if line.strip() == "::":
            i += 1
            continue
        line = re.sub(r"::$", ":", line)
        line = re.sub(r":([\w:.-]+):`([^`]+)`", _role, line)
        line = re.sub(r"``([^`]+)``", r"`\1`", line)
        line = re.sub(r"`([^`<]+?)\s*<[^`>]+>`_+", r"\1", line)
        line = re.sub(r"\|(\w+)\|", r"\1", line)
        out.append(line.rstrip())
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text


def python_docs(root: Path, max_chars: int) -> list[str]:
    base = root / "usr/share/doc/python3.11/html/_sources"
    order = ["tutorial", "glossary.rst.txt", "faq", "howto", "reference", "library"]
    files = []
    for name in order:
        p = base / name
        files.extend(sorted(p.rglob("*.rst.txt")) if p.is_dir() else [p])
    docs, total = [], 0
    for f in files:
        text = clean_rst(f.read_text(encoding="utf-8", errors="replace"))
        # split long files at paragraph boundaries into ~8 kB documents
        parts, cur = [], ""
        for para in text.split("\n\n"):
            if cur and len(cur) + len(para) > 8000:
                parts.append(cur)
                cur = ""
            cur = f"{cur}\n\n{para}" if cur else para
        if cur:
            parts.append(cur)
        for p in parts:
            if len(p) < 200:
                continue
            if total + len(p) > max_chars:
                return docs
            docs.append(p)
            total += len(p)
    return docs


# --------------------------------------------------------------------------- synthetic data


def _number(rng: random.Random, lo: int = 1, hi: int = 4) -> str:
    n = rng.randint(lo, hi)
    return str(rng.randint(10 ** (n - 1) if n > 1 else 0, 10 ** n - 1))


def kv_example(rng: random.Random, n_pairs: int | None = None,
               n_queries: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """'Remember: apple=42, ...' then queries; returns (context, [(question, answer)])."""
    n_pairs = n_pairs or rng.randint(2, 40)
    keys = rng.sample(KEYS, n_pairs)
    vals = [_number(rng) for _ in keys]
    ctx = "Remember: " + ", ".join(f"{k}={v}" for k, v in zip(keys, vals)) + "."
    n_queries = n_queries or rng.randint(1, 4)
    qa = []
    for _ in range(n_queries):
        j = rng.randrange(n_pairs)
        qa.append((f"What is {keys[j]}?", vals[j]))
    return ctx, qa


def filler_text(rng: random.Random, n_chars: int, pool: list[str] | None) -> str:
    """Irrelevant text of about n_chars: the standard passkey filler or corpus paragraphs."""
    if pool is None or rng.random() < 0.5:
        reps = STANDARD_FILLER * (n_chars // len(STANDARD_FILLER) + 1)
        return reps[:n_chars].rsplit(". ", 1)[0] + "."
    out = []
    size = 0
    while size < n_chars:
        p = rng.choice(pool)
        out.append(p)
        size += len(p) + 1
    return " ".join(out)[:n_chars].rsplit(" ", 1)[0]


def passkey_prompt(passkey: str, before: str, after: str) -> str:
    """The passkey task text up to and including the question (the answer follows)."""
    return (f"There is a passkey hidden in the text below. Remember it.\n{before} "
            f"The passkey is {passkey}. Remember it. {passkey} is the passkey. "
            f"{after}\nWhat is the passkey?")


def passkey_example(rng: random.Random, n_chars: int, pool: list[str] | None) -> str:
    passkey = str(rng.randint(10000, 99999))
    filler = filler_text(rng, n_chars, pool)
    cut = rng.randint(0, len(filler))
    sp = filler.rfind(". ", 0, cut)
    before, after = (filler[:sp + 1], filler[sp + 2:]) if sp >= 0 else ("", filler)
    return f"{passkey_prompt(passkey, before, after)} {passkey}"


def synthetic_doc(rng: random.Random, pool: list[str]) -> str:
    if rng.random() < 0.5:
        ctx, qa = kv_example(rng)
        return ctx + "\n" + "\n".join(f"{q} {a}" for q, a in qa)
    return passkey_example(rng, rng.randint(100, 1900), pool)


# --------------------------------------------------------------------------- chat data


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Apply CHAT_TEMPLATE (with jinja2 when installed; the same string either way)."""
    manual = BOS + "".join(f"<|{m['role']}|>\n{m['content']}{EOS}\n" for m in messages)
    if add_generation_prompt:
        manual += "<|assistant|>\n"
    try:
        import jinja2
    except ImportError:
        return manual
    out = jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=BOS, eos_token=EOS)
    assert out == manual, (out, manual)
    return out


SYSTEMS = ["You are a helpful assistant.", "You are a concise assistant.",
           "Answer briefly and accurately."]


def chat_examples(rng: random.Random, austen: list[str], jargon: list[tuple[str, str, str]],
                  n: int) -> list[str]:
    """Chat-formatted documents (already rendered, starting with <|bos|>)."""
    paras = [p for d in austen for p in d.split("\n\n") if 150 < len(p) < 1200]
    out = []
    for _ in range(n):
        kind = rng.random()
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
        if kind < 0.35 and jargon:
            term, _, definition = rng.choice(jargon)
            q = rng.choice([f"What does '{term}' mean?", f"Define {term}.",
                            f"What is {term} in hacker jargon?"])
            msgs += [{"role": "user", "content": q},
                     {"role": "assistant", "content": definition[:1200]}]
        elif kind < 0.7:
            p = rng.choice(paras)
            sents = re.split(r"(?<=[.!?]) ", p)
            k = max(1, len(sents) // 2)
            first, rest = " ".join(sents[:k]), " ".join(sents[k:]) or "..."
            q = rng.choice(["Continue this passage:\n", "Please continue the text:\n",
                            "What comes next?\n"]) + first
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": rest}]
        elif kind < 0.85:
            ctx, qa = kv_example(rng, n_queries=rng.randint(1, 3))
            msgs.append({"role": "user", "content": f"{ctx}\n{qa[0][0]}"})
            msgs.append({"role": "assistant", "content": qa[0][1]})
            for q, a in qa[1:]:
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        else:
            text = passkey_example(rng, rng.randint(100, 1200), paras)
            prompt, answer = text.rsplit(" ", 1)
            msgs += [{"role": "user", "content": prompt},
                     {"role": "assistant", "content": f"The passkey is {answer}."}]
        out.append(render_chat(msgs))
    return out


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # digits are split one by one so that numbers are copied digit by digit
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": None,
        "pad_token": EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"],
        "chat_template": CHAT_TEMPLATE,
    }


def encode_docs(tok, docs: list[str], wrap: bool) -> list[list[int]]:
    """Token ids of each document; natural documents get <|bos|> ... <|eos|> around them.

    Chat documents are rendered with their own <|bos|> and per-turn <|eos|> (wrap=False).
    """
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    out = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids = enc.ids
        out.append([bos, *ids, eos] if wrap else ids)
    return out


# --------------------------------------------------------------------------- main


def split(docs: list[str], every: int, tag: str) -> tuple[list[str], list[str]]:
    """Deterministic held-out split by a hash of each document."""
    train, valid = [], []
    for d in docs:
        h = int(hashlib.sha256((tag + d[:400]).encode()).hexdigest(), 16)
        (valid if h % every == 0 else train).append(d)
    return train, valid


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".data/data", help="output folder")
    ap.add_argument("--work", default=".data/src", help="downloads and extracted packages")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--python-chars", type=int, default=4_000_000,
                    help="cap on cleaned Python documentation characters")
    ap.add_argument("--synthetic-frac", type=float, default=0.15,
                    help="target fraction of training tokens that are synthetic recall data")
    ap.add_argument("--chat-frac", type=float, default=0.04,
                    help="target fraction of training tokens that are chat examples")
    ap.add_argument("--valid-every", type=int, default=40,
                    help="about 1 in N natural documents is held out")
    args = ap.parse_args(argv)
    import numpy as np

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    info = fetch(work)
    root = work / "extract"
    lic_dir = out / "licenses"
    lic_dir.mkdir(exist_ok=True)
    for meta in info.values():
        shutil.copyfile(meta["copyright"], lic_dir / f"{meta['package']}.copyright")

    austen = austen_docs(read_austen(root))
    entries = jargon_entries(root)
    jargon = jargon_docs(entries)
    pydocs = python_docs(root, args.python_chars)
    natural = {"austen": austen, "jargon": jargon, "python_docs": pydocs}
    train_nat, valid_nat = {}, {}
    for name, docs in natural.items():
        train_nat[name], valid_nat[name] = split(docs, args.valid_every, name)
        chars = sum(map(len, docs))
        info[name].update(documents=len(docs), chars=chars,
                          valid_documents=len(valid_nat[name]))
        print(f"{name:12s} {len(docs):6d} docs {chars / 1e6:6.2f} M chars "
              f"({len(valid_nat[name])} held out)", flush=True)

    rng = random.Random(args.seed)
    pool = [p for d in train_nat["austen"] for p in d.split("\n\n") if len(p) > 80]
    valid_pool = [p for d in valid_nat["austen"] for p in d.split("\n\n") if len(p) > 80]
    nat_train_chars = sum(len(d) for docs in train_nat.values() for d in docs)

    # synthetic and chat data, sized by characters first, measured in tokens below
    synth, size = [], 0
    while size < nat_train_chars * args.synthetic_frac / (1 - args.synthetic_frac):
        synth.append(synthetic_doc(rng, pool))
        size += len(synth[-1])
    # chat answers quote definitions: facts to learn (held-out perplexity never sees chat)
    jargon_train = entries
    chat, size = [], 0
    chat_rng = random.Random(args.seed + 1)
    while size < nat_train_chars * args.chat_frac:
        chat.extend(chat_examples(chat_rng, train_nat["austen"], jargon_train, 50))
        size = sum(map(len, chat))
    vrng = random.Random(args.seed + 2)
    valid_synth = [synthetic_doc(vrng, valid_pool) for _ in range(200)]

    print("training tokenizer", flush=True)
    all_train = [d for docs in train_nat.values() for d in docs]
    tok = train_tokenizer(all_train + synth[: len(synth) // 4] + chat[: len(chat) // 4],
                          args.vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    print("encoding", flush=True)
    kinds = {"natural": encode_docs(tok, all_train, True),
             "synthetic": encode_docs(tok, synth, True),
             "chat": encode_docs(tok, chat, False)}
    docs = [ids for group in kinds.values() for ids in group]
    random.Random(args.seed + 3).shuffle(docs)
    train = np.fromiter((t for d in docs for t in d), dtype=np.uint16)
    train.tofile(out / "train.bin")
    valid_docs = encode_docs(tok, [d for docs in valid_nat.values() for d in docs], True)
    valid = np.fromiter((t for d in valid_docs for t in d), dtype=np.uint16)
    valid.tofile(out / "valid.bin")
    vs = np.fromiter((t for d in encode_docs(tok, valid_synth, True) for t in d), np.uint16)
    vs.tofile(out / "valid_synthetic.bin")
    counts = {k: sum(map(len, v)) for k, v in kinds.items()}
    total = sum(counts.values())
    meta = {
        "seed": args.seed,
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "train_tokens": int(train.size),
        "valid_tokens": int(valid.size),
        "valid_synthetic_tokens": int(vs.size),
        "train_token_fractions": {k: round(v / total, 4) for k, v in counts.items()},
        "train_documents": {k: len(v) for k, v in kinds.items()},
        "sources": info,
        "args": vars(args),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    (out / "train_sample.txt").write_text(tok.decode(train[:20000].tolist(),
                                                     skip_special_tokens=False))
    print(json.dumps({k: meta[k] for k in ("vocab_size", "train_tokens", "valid_tokens",
                                           "train_token_fractions")}, indent=2))


if __name__ == "__main__":
    main()
