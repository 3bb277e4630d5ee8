"""Tests for ``mcserve.engine.tokenizer``: tokenizers, chat templates, streaming detokenization
and stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcserve.engine.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    find_stop,
    stop_holdback,
)

SENTENCES = [
    "Memory caching keeps a copy of the memory at the end of every segment.",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café — 世界 你好 🙂",
    "Recurrent models compress everything they have read into one state.",
] * 3

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

UNICODE_TEXT = "héllo 世界 🙂"


def train_bpe() -> object:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


@pytest.fixture(scope="module")
def bpe_backend() -> object:
    return train_bpe()


@pytest.fixture
def bpe_dir(tmp_path: Path, bpe_backend) -> Path:
    bpe_backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.fixture
def bpe(bpe_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(bpe_dir)


# --- byte level ------------------------------------------------------------------------------


def test_byte_level_round_trip() -> None:
    tok = Tokenizer.byte_level()
    ids = tok.encode(UNICODE_TEXT)
    assert ids == list(UNICODE_TEXT.encode("utf-8"))
    assert tok.decode(ids) == UNICODE_TEXT
    assert tok.vocab_size == 256
    assert tok.all_special_ids == [] and tok.eos_token_id is None and tok.bos_token_id is None
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # an incomplete character
    assert tok.decode([104, 300, 105]) == "hi"  # ids beyond the bytes are dropped
    assert tok.id_to_token(0xE9) == "é" and tok.token_to_id("é") == 0xE9
    assert tok.token_to_id("世") is None and tok.id_to_token(256) is None


def test_byte_level_chat_template() -> None:
    tok = Tokenizer.byte_level()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}]
    assert tok.apply_chat_template(msgs) == (
        "System: Be brief.\nUser: Hi\nAssistant: Hello.\nUser: Why?\nAssistant:"
    )
    assert tok.apply_chat_template(msgs[1:2], add_generation_prompt=False) == "User: Hi\n"


# --- tokenizer.json + tokenizer_config.json --------------------------------------------------


def test_from_dir_round_trip(bpe: Tokenizer, bpe_backend) -> None:
    assert bpe.vocab_size == bpe_backend.get_vocab_size()
    assert (bpe.bos_token_id, bpe.eos_token_id) == (0, 1)
    assert bpe.all_special_ids == [0, 1, 2]
    assert bpe.id_to_token(1) == "</s>" and bpe.token_to_id("<pad>") == 2
    for text in [*SENTENCES[:4], "unseen: Ωmega ∑ 🚀 tabs\tand\nnewlines", ""]:
        ids = bpe.encode(text)
        assert ids[0] == bpe.bos_token_id  # add_bos_token
        assert bpe.decode(ids) == text
        assert bpe.encode(text, add_special_tokens=False) == ids[1:]


def test_bos_is_not_doubled_and_special_tokens_decode(bpe: Tokenizer) -> None:
    ids = bpe.encode("<s>hello</s>")
    assert ids[0] == 0 and ids[1] != 0 and ids[-1] == 1
    assert bpe.decode(ids) == "hello"
    assert bpe.decode(ids, skip_special_tokens=False) == "<s>hello</s>"


def test_chat_template_renders(bpe: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert bpe.apply_chat_template(msgs) == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    )
    assert bpe.apply_chat_template(msgs, add_generation_prompt=False).endswith("Hi</s>\n")
    # OpenAI content parts are joined into one string
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert "<|user|>\na\nb</s>" in bpe.apply_chat_template(parts)
    prompt = bpe.apply_chat_template(msgs)
    ids = bpe.encode(prompt, add_special_tokens=False)
    assert ids.count(bpe.bos_token_id) == 1 and bpe.decode(ids, False) == prompt


def test_chat_template_raise_exception_is_value_error(bpe: Tokenizer) -> None:
    with pytest.raises(ValueError, match="unknown role tool"):
        bpe.apply_chat_template([{"role": "tool", "content": "42"}])


def test_chat_template_sandbox_and_syntax_errors() -> None:
    tok = Tokenizer.byte_level()
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% if %}")
    # the immutable sandbox refuses to mutate the messages
    evil = "{% set _ = messages.append({'role': 'x'}) %}ok"
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=evil)


def test_chat_template_helpers_and_kwargs() -> None:
    tok = Tokenizer.byte_level()
    template = "{{ messages | tojson }}|{{ extra }}|{{ strftime_now('%Y') | length }}"
    out = tok.apply_chat_template([{"role": "user", "content": "<é>"}], chat_template=template,
                                  extra="E")
    assert out == '[{"role": "user", "content": "<é>"}]|E|4'


def test_chat_template_jinja_file_and_list_form(bpe_dir: Path) -> None:
    cfg = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"},
                            {"name": "default", "template": "D{{ messages | length }}"}]
    (bpe_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_dir(bpe_dir).apply_chat_template(msgs) == "D1"
    (bpe_dir / "chat_template.jinja").write_text("J{{ eos_token }}")
    assert Tokenizer.from_dir(bpe_dir).apply_chat_template(msgs) == "J</s>"


def test_from_dir_without_config(tmp_path: Path, bpe_backend) -> None:
    bpe_backend.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id is None and tok.eos_token_id is None
    assert tok.encode("hello")[0] != 0  # no BOS without add_bos_token
    assert tok.all_special_ids == [0, 1, 2]  # still the tokens marked special
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "User: x\nAssistant:"


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        {"role": "user", "content": "x"},
        [],
        ["hello"],
        [{"content": "x"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        [{"role": "user", "content": [{"type": "text", "text": 1}]}],
        [{"role": "user", "content": ["plain"]}],
    ],
)
def test_bad_messages_raise(messages) -> None:
    with pytest.raises(ValueError, match=r"^messages"):
        Tokenizer.byte_level().apply_chat_template(messages)


# --- incremental detokenization --------------------------------------------------------------


def stream(tok: Tokenizer, prompt_ids: list[int], output_ids: list[int], skip: bool = True):
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in output_ids]
    return detok, deltas


@pytest.mark.parametrize("prompt", ["", "a", "前缀 🙂"])
def test_incremental_byte_level_multibyte(prompt: str) -> None:
    tok = Tokenizer.byte_level()
    out_ids = tok.encode(UNICODE_TEXT)
    detok, deltas = stream(tok, tok.encode(prompt), out_ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == tok.decode(out_ids) == UNICODE_TEXT
    assert deltas[:2] == ["h", ""]  # é is held back until its second byte arrives
    assert deltas[2] == "é"
    assert detok.flush() == "" and detok.output_ids == out_ids


def test_incremental_bpe_matches_full_decode(bpe: Tokenizer) -> None:
    prompt = bpe.encode("A prompt:")
    for text in [*SENTENCES[:4], "🙂🙂 emoji  spaces\n\nend"]:
        out_ids = bpe.encode(text, add_special_tokens=False) + [bpe.eos_token_id]
        detok, deltas = stream(bpe, prompt, out_ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == detok.text == bpe.decode(out_ids) == text
        detok, deltas = stream(bpe, prompt, out_ids, skip=False)
        assert detok.text == bpe.decode(out_ids, skip_special_tokens=False) == text + "</s>"


def test_incremental_bpe_rare_characters_split_over_byte_tokens(bpe: Tokenizer) -> None:
    text = "ꙮ𝄞"  # unseen in training: each character is several single-byte tokens
    out_ids = bpe.encode(text, add_special_tokens=False)
    assert len(out_ids) == len(text.encode("utf-8"))
    detok, deltas = stream(bpe, [], out_ids)
    assert [d for d in deltas if d] == ["ꙮ", "𝄞"]


def test_incremental_flush_emits_a_trailing_incomplete_character() -> None:
    tok = Tokenizer.byte_level()
    out_ids = [*b"ok ", 0xF0, 0x9F]  # the start of a 4-byte emoji
    detok, deltas = stream(tok, [], out_ids)
    assert "".join(deltas) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == tok.decode(out_ids)
    # an invalid byte in the middle is emitted once text follows it
    detok, deltas = stream(tok, [], [*b"a", 0xFF, *b"b"])
    assert "".join(deltas) == detok.text == "a\ufffdb"


def test_incremental_keeps_a_sentencepiece_leading_space() -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3},
                                       unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = Tokenizer(backend)
    detok, deltas = stream(tok, [1], [2, 3])
    assert deltas == [" world", " again"]
    assert tok.decode([1]) + detok.text == tok.decode([1, 2, 3])


# --- stop strings ----------------------------------------------------------------------------


def test_find_stop_across_token_boundaries() -> None:
    pieces = ["Hel", "lo S", "T", "OP and more"]
    text, found = "", None
    for piece in pieces:
        start = len(text)
        text += piece
        found = find_stop(text, start, ["STOP"])
        if found:
            break
    assert piece == "OP and more" and found == (6, "STOP")
    assert text[: found[0]] == "Hello "


def test_find_stop_earliest_and_start() -> None:
    text = "abc END xyz STOP"
    assert find_stop(text, 0, ["STOP", "END"]) == (4, "END")
    assert find_stop(text, 8, ["STOP", "END"]) == (12, "STOP")  # END ended before start
    assert find_stop(text, 6, ["END"]) == (4, "END")  # its last character is new
    assert find_stop(text, 7, ["END"]) is None
    assert find_stop("xxabcd", 0, ["abcd", "ab"]) == (2, "ab")  # same index: the shorter
    assert find_stop("hello", 0, []) is None


def test_stop_holdback() -> None:
    assert stop_holdback("Hello ST", ["STOP"]) == 2
    assert stop_holdback("Hello", ["STOP"]) == 0
    assert stop_holdback("Hello", ["\n\n", "lo!", "o!!"]) == 2
    assert stop_holdback("x\n", ["\n\n"]) == 1
    assert stop_holdback("", ["abc"]) == 0
    assert stop_holdback("ab", ["abc"]) == 2


def test_streaming_with_stops_never_leaks_the_stop(bpe: Tokenizer) -> None:
    """How an engine combines the pieces: stream deltas, hold back a possible stop prefix."""
    full = "The answer is 42.\n\nUser: next question"
    out_ids = bpe.encode(full, add_special_tokens=False)
    stops = ["\n\nUser:"]
    detok = IncrementalDetokenizer(bpe, [], skip_special_tokens=True)
    sent = 0
    streamed = ""
    for tid in out_ids:
        start = len(detok.text)
        detok.add(tid)
        hit = find_stop(detok.text, start, stops)
        if hit:
            streamed += detok.text[sent: hit[0]]
            break
        safe = len(detok.text) - stop_holdback(detok.text, stops)
        streamed += detok.text[sent:safe]
        sent = max(sent, safe)
    assert hit is not None
    assert streamed == "The answer is 42."
