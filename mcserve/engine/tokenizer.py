"""Tokenizer wrapper, chat templates, incremental detokenization and stop-string helpers.

``Tokenizer.from_dir`` reads a Hugging Face style directory (``tokenizer.json`` through the
``tokenizers`` library, ``tokenizer_config.json``, optional ``chat_template.jinja``);
``Tokenizer.byte_level()`` is the fallback where ids 0..255 are UTF-8 bytes. Chat templates are
rendered with jinja2's sandbox, as transformers does. See docs/engine-sampling.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import jinja2
    import tokenizers

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "IncrementalDetokenizer",
    "RWKVWorldTokenizer",
    "Tokenizer",
    "find_stop",
    "load_tokenizer",
    "stop_holdback",
]

# Used when the tokenizer has no chat template of its own (and by the byte-level tokenizer):
#   "System: ...\nUser: ...\nAssistant: ...\nAssistant:"
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Tokens before the new ones that are decoded with them (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION
# _OFFSET): enough context for decoders whose output depends on the previous token.
_DETOKENIZE_CONTEXT = 5
_REPLACEMENT = "\ufffd"


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or an AddedToken dict, got {value!r}")


def _pick_template(value: Any) -> str | None:
    """``chat_template`` is a string, or (some configs) a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default", next(iter(named.values()), None))
        if isinstance(chosen, str):
            return chosen
    raise ValueError(f"chat_template must be a string, got {type(value).__name__}")


def _normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages; OpenAI text content-part lists become one string (joined by \\n)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of messages, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content', "
                             f"got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} must have a non-empty string 'role'")
        if "content" not in msg:
            raise ValueError(f"{where} must have a 'content'")
        content = msg["content"]
        if isinstance(content, (list, tuple)):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                    raise ValueError(f"{where}.content[{j}]: only text content parts are "
                                     f"supported, got {kind!r}")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{j}] must have a string 'text'")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        out.append({**msg, "role": role, "content": content})
    return out


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' version: no HTML escaping (jinja2's built-in tojson escapes < > & ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Text <-> token ids, over a ``tokenizers.Tokenizer`` or raw UTF-8 bytes (``backend=None``).

    Build it with :meth:`from_dir` or :meth:`byte_level`.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_special_tokens: Sequence[str] = (),
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template  # None: DEFAULT_CHAT_TEMPLATE is used
        self._extra_special = tuple(extra_special_tokens)
        self._compiled: dict[str, jinja2.Template] = {}

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required), ``tokenizer_config.json`` and
        ``chat_template.jinja`` (both optional; the .jinja file wins over the config's
        ``chat_template``) from a directory."""
        from tokenizers import Tokenizer as _Backend

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ValueError(f"{tok_file} is not a valid tokenizer file: {e}") from None

        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{cfg_file} must hold a JSON object")

        template = _pick_template(config.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        extra = [
            t for t in (_token_content(config.get(k)) for k in ("unk_token", "pad_token"))
            if t is not None
        ]
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=template,
            extra_special_tokens=extra,
        )

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """Ids 0..255 are the UTF-8 bytes; no special tokens; the default chat template."""
        return cls(None)

    # --- vocabulary ----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        if self._backend is None:
            return 256
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry ``token`` (byte-level: one latin-1 character), or None."""
        if self._backend is None:
            return ord(token) if len(token) == 1 and ord(token) < 256 else None
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (byte-level: the byte as latin-1), or None."""
        if self._backend is None:
            return chr(token_id) if 0 <= token_id < 256 else None
        return self._backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of the added tokens marked special plus bos/eos/unk/pad."""
        if self._backend is None:
            return []
        ids = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        for tok in (self.bos_token, self.eos_token, *self._extra_special):
            if tok is not None and (i := self._backend.token_to_id(tok)) is not None:
                ids.add(i)
        return sorted(ids)

    # --- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With ``add_special_tokens`` the tokenizer's post-processor
        runs and BOS (EOS) is added when the config says ``add_bos_token`` (``add_eos_token``),
        unless already there. Chat-templated prompts usually carry their own BOS: encode them
        with ``add_special_tokens=False``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self._backend is None:
            return list(text.encode("utf-8"))
        # encode_batch releases the GIL while it works (a lone encode does not): a long prompt
        # tokenized on a worker thread then leaves the server's event loop free
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            if self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
                ids.append(eos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD, unknown ids are dropped."""
        ids = [int(i) for i in ids]
        if self._backend is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    # --- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with ``chat_template`` (default: the tokenizer's own, else
        :data:`DEFAULT_CHAT_TEMPLATE`). Extra keyword arguments become template variables.

        Raises ValueError for malformed messages (message starts with "messages") and for a
        template that fails to compile or calls ``raise_exception``."""
        msgs = _normalise_messages(messages)
        template = self._template(chat_template or self.chat_template or DEFAULT_CHAT_TEMPLATE)
        import jinja2

        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **kwargs,
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None

    def _template(self, source: str) -> jinja2.Template:
        if source not in self._compiled:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            try:
                self._compiled[source] = env.from_string(source)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"chat template does not compile: {e}") from None
        return self._compiled[source]


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas for streaming.

    Each :meth:`add` decodes a small window (a few earlier tokens, starting with the end of the
    prompt, plus the new ones) and returns the text it adds. While the window's text ends in
    U+FFFD (an incomplete UTF-8 character) nothing is emitted; the bytes are held until the
    character completes. :meth:`flush` emits what is still held (call it when the sequence ends).

    ``text`` is everything emitted so far. For context-free decoders (byte level, GPT-2 style
    byte-level BPE) it ends equal to ``tokenizer.decode(output ids)``; for decoders that strip a
    leading space from the first token (SentencePiece "▁"), the prompt context keeps that space,
    so that ``prompt text + text`` reads right (as vLLM does).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(i) for i in prompt_ids[-_DETOKENIZE_CONTEXT:]] if prompt_ids else []
        self._ids: list[int] = context  # context + output ids
        self._n_context = len(context)
        self._prefix = 0  # window start
        self._read = len(context)  # end of what has been emitted
        self.text = ""

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._n_context:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the new text (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is held back (e.g. a trailing incomplete character, as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta


# --- loading -------------------------------------------------------------------------------------


def load_tokenizer(model_dir: str | Path, tokenizer_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint: ``tokenizer_dir`` when given (it must hold a
    ``tokenizer.json``), else ``model_dir``'s ``tokenizer.json`` when there is one, else
    :meth:`Tokenizer.byte_level`.

    Raises FileNotFoundError when ``tokenizer_dir`` has no ``tokenizer.json`` and ValueError for
    an unreadable tokenizer file or config."""
    if tokenizer_dir is not None:
        return Tokenizer.from_dir(tokenizer_dir)
    path = Path(model_dir)
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_dir(path)
    if _is_rwkv_checkpoint(path):  # RWKV ships no tokenizer.json: the World vocabulary
        return RWKVWorldTokenizer()
    return Tokenizer.byte_level()


def chat_resume_positions(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                          prompt_ids: list[int], *, chat_template: str | None = None,
                          **template_kwargs: Any) -> list[int]:
    """Token positions in ``prompt_ids`` (the rendered and tokenized chat prompt) where a
    message ends, for the engine to keep resume points at: the first message's end (a system
    prompt that other conversations share), the ends of the last two messages before the new
    one, and the prompt's end (where the next turn, which repeats this prompt and adds the
    answer, resumes). A prefix whose tokens are not a prefix of ``prompt_ids`` (a template
    that renders earlier messages differently, a merge across the boundary) is left out.
    ``template_kwargs`` are the template variables the prompt was rendered with (``tools``)."""
    n = len(messages)
    out = {len(prompt_ids)}
    for k in sorted({1, n - 2, n - 1}):
        if not 1 <= k < n:
            continue
        try:
            text = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=False,
                                                 chat_template=chat_template, **template_kwargs)
        except Exception:  # noqa: BLE001 - a template may refuse a partial conversation
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and len(ids) < len(prompt_ids) and prompt_ids[:len(ids)] == ids:
            out.add(len(ids))
    return sorted(out)


# --- stop strings --------------------------------------------------------------------------------


def find_stop(text: str, start: int, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends at or after index ``start``.

    ``start`` is where the newly added text begins (the earlier text was already checked), so a
    stop string split across tokens is found once its last piece arrives. Returns
    ``(index, stop)`` with ``text[index:index + len(stop)] == stop``, or None. On a tie the
    shorter stop (the one that ends first) wins.
    """
    best: tuple[int, int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx != -1 and (best is None or (idx, len(stop)) < best[:2]):
            best = (idx, len(stop), stop)
    return None if best is None else (best[0], best[2])


def stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could begin a stop string (hold them back from
    streaming until the next token says whether the stop completes)."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold


# --- RWKV World ----------------------------------------------------------------------------------
# RWKV checkpoints (BlinkDL's .pth, fla-hub's rwkv7 directories) ship without a tokenizer.json;
# they were trained with the World vocabulary (65529 byte strings, ids 1..65529, greedy longest
# match over the UTF-8 bytes), which the rwkv package ships with its trie tokenizer. Id 0 ends a
# document (the eos id) and stands for no text. Decoding replaces invalid UTF-8 with U+FFFD, so
# the incremental detokenizer holds a character split across tokens until it completes.


def _is_rwkv_checkpoint(path: Path) -> bool:
    """A BlinkDL ``.pth`` file, or a directory whose config.json says ``model_type: rwkv7``."""
    if path.suffix == ".pth" and path.is_file():
        return True
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") == "rwkv7"


#: RWKV's chat format: "User: ...\n\nAssistant: ...\n\n", ending with "Assistant:"
RWKV_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
_VOCAB_NAME = "rwkv_vocab_v20230424.txt"


def _import_trie():
    try:
        from rwkv.rwkv_tokenizer import TRIE_TOKENIZER
    except ImportError:
        raise ImportError("the RWKV World tokenizer needs the 'rwkv' package (pip install rwkv), "
                          "which ships the vocabulary; or pass a tokenizer directory "
                          "(--tokenizer DIR with a tokenizer.json)") from None
    return TRIE_TOKENIZER


def world_vocab_file() -> Path:
    """The World vocabulary file the ``rwkv`` package ships."""
    _import_trie()
    import rwkv

    return Path(rwkv.__file__).resolve().parent / _VOCAB_NAME


class RWKVWorldTokenizer(Tokenizer):
    """Text ↔ ids with the RWKV World vocabulary (``rwkv`` package's ``TRIE_TOKENIZER``)."""

    EOS_ID = 0

    def __init__(self, vocab_file: str | Path | None = None) -> None:
        trie_cls = _import_trie()
        file = Path(vocab_file) if vocab_file is not None else world_vocab_file()
        if not file.is_file():
            raise FileNotFoundError(f"RWKV World vocabulary {file} does not exist")
        # the trie is the backend: not a ``tokenizers`` object, so the server neither bounds
        # prompt bytes per token (RWKV tokens hold up to 128 bytes) nor batches it
        super().__init__(trie_cls(str(file)), chat_template=RWKV_CHAT_TEMPLATE)
        self._tokens: dict[int, bytes] = self._backend.idx2token

    @cached_property
    def vocab_size(self) -> int:  # type: ignore[override]
        return max(self._tokens) + 1

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token2idx.get(token.encode("utf-8"))

    def id_to_token(self, token_id: int) -> str | None:
        raw = self._tokens.get(int(token_id))
        return None if raw is None else raw.decode("utf-8", errors="replace")

    @property
    def bos_token_id(self) -> int | None:
        return None

    @property
    def eos_token_id(self) -> int | None:
        return self.EOS_ID

    @cached_property
    def all_special_ids(self) -> list[int]:
        return [self.EOS_ID]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (RWKV adds no special tokens)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self._backend.encode(text) if text else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD, unknown ids (and 0) are dropped."""
        raw = b"".join(self._tokens.get(int(i), b"") for i in ids)
        return raw.decode("utf-8", errors="replace")
