"""Every hybrid family against transformers' own modeling code (tiny random models saved with
``save_pretrained``, tests/hybrid_models): logits of several prompt lengths, the same logits
with the prompt split into pieces (prefill + decode), packed variable-length calls, and greedy
tokens."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import FAMILIES

from mcserve.models.registry import load_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = FAMILIES[request.param].save_tiny(path)
    return ref, load_model(path), ref.config.vocab_size


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 7, 33])
def test_logits_match_transformers(pair, T):
    ref, ours, V = pair
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(T))
    want = ref(ids).logits
    got, _ = ours(ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_prompt_split_into_pieces_gives_the_same_logits(pair):
    ref, ours, V = pair
    ids = torch.randint(0, V, (1, 29), generator=torch.Generator().manual_seed(1))
    want = ref(ids).logits
    state, outs = None, []
    for a, b in [(0, 11), (11, 12), (12, 13), (13, 29)]:
        o, state = ours(ids[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_varlen_call_matches_each_sequence_alone(pair):
    ref, ours, V = pair
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (9, 1, 17)]
    states = [ours.init_state(1) for _ in seqs]
    cut = [4, 1, 6]
    first = [s[:c] for s, c in zip(seqs, cut)]
    _, states = ours.forward_varlen(torch.cat(first)[None], states, cut)
    rest = [s[c:] for s, c in zip(seqs, cut) if len(s) > c]
    keep = [st for s, c, st in zip(seqs, cut, states) if len(s) > c]
    logits, _ = ours.forward_varlen(torch.cat(rest)[None], keep, [len(r) for r in rest])
    wants = [ref(s[None]).logits[0, -1] for s, c in zip(seqs, cut) if len(s) > c]
    torch.testing.assert_close(logits, torch.stack(wants), atol=ATOL, rtol=0)


@torch.no_grad()
def test_greedy_tokens_match_transformers(pair):
    ref, ours, V = pair
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(3))
    want = ref.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                        eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    got, state, tok = [], None, ids
    for _ in range(16):
        logits, state = ours(tok, state)
        tok = logits[:, -1:].argmax(-1)
        got.append(int(tok))
    assert got == want


def test_eval_ppl_runs_with_post_hoc_mc(pair, tmp_path):
    """``mcserve eval ppl`` on the family, the model as trained beside post-hoc MC on its
    recurrent layers (LFM2: as trained only; its convolutions keep no memory)."""
    import json

    from mcserve.cli import main

    ref, ours, V = pair
    path = tmp_path / "m"
    ref.save_pretrained(path)
    text = tmp_path / "text.txt"
    text.write_text("THE GRASS IS GREEN AND THE SKY IS BLUE. " * 20)  # byte ids below 97
    out = tmp_path / "ppl.json"
    args = ["eval", "ppl", str(path), "--data", str(text), "--lengths", "48", "--no-progress",
            "--json", str(out)]
    mc = ref.config.model_type != "lfm2"
    assert main(args + ["--mc", "post:16,grm:16" if mc else ""]) == 0
    rows = json.dumps(json.loads(out.read_text()))
    assert ("grm" in rows) == mc
