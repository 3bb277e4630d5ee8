"""Every hybrid family against transformers' own modeling code (tiny random models saved with
``save_pretrained``, tests/hybrid_models): logits of several prompt lengths, the same logits
with the prompt split into pieces (prefill + decode), packed variable-length calls, and greedy
tokens."""

from __future__ import annotations

import pytest
import torch
from hybrid_models import FAMILIES, MC_FAMILIES

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


@pytest.mark.parametrize("fam", sorted(FAMILIES))
def test_eval_ppl_and_passkey_run_with_post_hoc_mc(fam, tmp_path):
    """``mcserve eval ppl`` and ``passkey`` on the family (a byte-sized vocabulary, so the
    evaluations' own byte tokenizer fits), the model as trained beside post-hoc MC on its
    recurrent layers (LFM2: as trained only; its convolutions keep no memory)."""
    import json

    from mcserve.cli import main

    path = tmp_path / "m"
    FAMILIES[fam].save_tiny(path, vocab_size=256)
    text = tmp_path / "text.txt"
    text.write_text("The grass is green and the sky is blue. " * 20)
    mc = ["--mc", "post:16,grm:16" if fam in MC_FAMILIES else ""]
    out = tmp_path / "ppl.json"
    assert main(["eval", "ppl", str(path), "--data", str(text), "--lengths", "48",
                 "--no-progress", "--json", str(out), *mc]) == 0
    assert ("grm" in json.dumps(json.loads(out.read_text()))) == (fam in MC_FAMILIES)
    out = tmp_path / "passkey.json"
    assert main(["eval", "passkey", str(path), "--lengths", "320", "--depths", "0.5",
                 "--trials", "1", "--no-progress", "--json", str(out), *mc]) == 0
    assert ("post" in out.read_text()) == (fam in MC_FAMILIES)


@pytest.fixture(scope="module", params=MC_FAMILIES)
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"mc-{request.param}")
    FAMILIES[request.param].save_tiny(path)
    return path


@torch.no_grad()
@pytest.mark.parametrize("variant", ["grm", "post"])
def test_post_hoc_mc_applies_to_the_recurrent_layers(saved, variant):
    """``load_model(path, mc_overrides=...)`` puts the variant on every recurrent mixer and
    leaves the attention layers as they are; under it, prefill then decode equals one call and
    packed calls equal each sequence alone; the first segment is the model as trained and the
    first recurrent layer reads its cached segments after it."""
    plain = load_model(saved)
    mc = load_model(saved, mc_overrides={"mc_variant": variant, "segment_len": 8})
    assert (mc.config.mc_variant, mc.config.segment_len) == (variant, 8)
    assert mc.layers and all(b.mixer.memory.cfg.variant == variant for b in mc.layers)
    assert len(mc.attn_layers) == len(plain.attn_layers) > 0
    V = plain.config.vocab_size
    ids = torch.randint(0, V, (1, 30), generator=torch.Generator().manual_seed(1))
    full, _ = mc(ids)
    state, outs = None, []
    for a, b in [(0, 11), (11, 12), (12, 19), (19, 20), (20, 30)]:
        o, state = mc(ids[:, a:b], state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=ATOL, rtol=0)
    want, _ = plain(ids)
    torch.testing.assert_close(full[:, :8], want[:, :8], atol=ATOL, rtol=0)
    seen = []
    for model in (plain, mc):
        hook = model.layers[0].mixer.register_forward_hook(lambda m, i, o: seen.append(o[0]))
        model(ids)
        hook.remove()
    torch.testing.assert_close(seen[1][:, :8], seen[0][:, :8], atol=1e-6, rtol=0)
    assert (seen[1][:, 8:] - seen[0][:, 8:]).abs().max() > 1e-3 * seen[0].abs().max()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (13, 5, 21)]
    logits, _ = mc.forward_varlen(torch.cat(seqs)[None], [mc.init_state(1) for _ in seqs],
                                  [len(s) for s in seqs])
    alone = torch.stack([mc(s[None])[0][0, -1] for s in seqs])
    torch.testing.assert_close(logits, alone, atol=ATOL, rtol=0)
