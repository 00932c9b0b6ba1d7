"""A checkpoint's tokenizer read by the Rust `tokenizers` library alone: what longspec
asks of a tokenizer (encode, decode, special tokens, the chat template), giving the ids
and text of the `transformers` tokenizer the same files make, without importing
`transformers` (seconds at every start) or its Python parsing of `tokenizer.json`.

Only files whose every setting this type reproduces are read here (`fast_path_problem`);
any other directory keeps `transformers`' own tokenizer (`read_tokenizer`). Chat templates
are rendered by `transformers`' own renderer, imported when a chat is first rendered."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from pathlib import Path

import tokenizers

# transformers' named special tokens, in its order (all_special_tokens lists them so).
NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json keys this type reads, or that change nothing it does.
_KNOWN_KEYS = frozenset(NAMED_SPECIAL) | {
    "backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only", "chat_template",
    "clean_up_tokenization_spaces", "split_special_tokens", "extra_special_tokens", "additional_special_tokens",
    "padding_side", "truncation_side", "model_input_names", "added_tokens_decoder", "name_or_path",
    "add_prefix_space", "legacy", "use_default_system_prompt", "spaces_between_special_tokens", "sp_model_kwargs",
}
# Classes whose transformers constructor keeps tokenizer.json's pipeline as written
# (checked id for id by tests/test_tokenizer.py: the embedded Gemma and a tiny WordLevel one).
_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast"})


class Encoding(dict):
    """What calling a tokenizer returns: `.input_ids`, or `["input_ids"]` as from
    `transformers`' BatchEncoding."""

    def __init__(self, input_ids: list[int]) -> None:
        dict.__init__(self, input_ids=input_ids)

    @property
    def input_ids(self) -> list[int]:
        return self["input_ids"]


class Tokenizer:
    """A `tokenizers.Tokenizer` with a checkpoint's special tokens and chat template. Safe
    to share between threads without a copy: its one mutable backend setting (whether
    special-token strings are matched) changes only under its own lock, which encoding
    holds (with the GIL released) and decoding never needs."""

    def __init__(self, backend: tokenizers.Tokenizer, settings: dict, chat_template: str | None, source: str) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.name_or_path = source
        self._settings = settings
        self._named = {name: _content(settings[name]) for name in NAMED_SPECIAL if settings.get(name) is not None}
        extra = settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []
        ordered = list(self._named.values()) + [_content(token) for token in extra]
        self.all_special_tokens = list(dict.fromkeys(ordered))
        self.all_special_ids = [self.convert_tokens_to_ids(token) for token in self.all_special_tokens]
        self._split_default = bool(settings.get("split_special_tokens", False))
        # transformers applies its clean-up to WordPiece-style models, never to BPE ones.
        self._clean_up = (bool(settings.get("clean_up_tokenization_spaces", False))
                          and type(backend.model).__name__ != "BPE")
        self._lock = threading.Lock()

    def __deepcopy__(self, memo) -> Tokenizer:
        with self._lock:
            backend = tokenizers.Tokenizer.from_str(self.backend_tokenizer.to_str())
        return Tokenizer(backend, copy.deepcopy(self._settings), self.chat_template, self.name_or_path)

    def backend_json(self) -> str:
        """The Rust pipeline's JSON, as `transformers`' backend serialises it (special-token
        strings matched): what llguidance builds its vocabulary from."""
        with self._lock:
            self.backend_tokenizer.encode_special_tokens = False
            return self.backend_tokenizer.to_str()

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._named)

    @property
    def added_tokens_decoder(self) -> dict[int, tokenizers.AddedToken]:
        return self.backend_tokenizer.get_added_tokens_decoder()

    def _named_id(self, name: str) -> int | None:
        token = self._named.get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_id("unk_token")

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            index = self.backend_tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool | None = None) -> list[int]:
        split = self._split_default if split_special_tokens is None else split_special_tokens
        with self._lock:  # the flag holds for this call; the batch call releases the GIL meanwhile
            if self.backend_tokenizer.encode_special_tokens != split:
                self.backend_tokenizer.encode_special_tokens = split
            return self.backend_tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool | None = None) -> Encoding:
        if not isinstance(text, str):
            raise TypeError(f"the tokenizer encodes one string at a time, not {type(text).__name__}")
        return Encoding(self.encode(text, add_special_tokens, split_special_tokens))

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def apply_chat_template(self, conversation: Sequence[dict], add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, **kwargs):
        """The conversation rendered as `transformers` renders it (its own renderer: the
        same sandbox, filters and message normalisation), then tokenized without the
        tokens the tokenizer adds itself, as `transformers` does."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template: set tokenizer.chat_template or pass chat_template")
        if not conversation:
            raise ValueError("the conversation is empty")
        from transformers.utils.chat_template_utils import (
            _normalize_chat_messages,
            render_jinja_template,
        )

        rendered, _ = render_jinja_template(conversations=[_normalize_chat_messages(conversation)],
                                            chat_template=template, add_generation_prompt=add_generation_prompt,
                                            **{**self.special_tokens_map, **kwargs})
        text = rendered[0]
        return Encoding(self.encode(text, add_special_tokens=False)) if tokenize else text


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


def _settings(directory: Path) -> dict:
    path = directory / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def fast_path_problem(directory: Path, settings: dict) -> str | None:
    """Why these files need `transformers`' tokenizer to give its exact behaviour, or None."""
    if not (directory / "tokenizer.json").is_file():
        return "no tokenizer.json (a slow tokenizer's files are converted by transformers)"
    unknown = sorted(set(settings) - _KNOWN_KEYS)
    if unknown:
        return f"tokenizer_config.json sets {', '.join(unknown)}, which transformers applies itself"
    if settings.get("tokenizer_class", "TokenizersBackend") not in _CLASSES:
        return f"tokenizer class {settings['tokenizer_class']} may rebuild the pipeline in transformers"
    for key in ("extra_special_tokens", "additional_special_tokens"):
        if not isinstance(settings.get(key) or [], list):
            return f"{key} names model-specific special tokens"
    template = settings.get("chat_template")
    if template is not None and not isinstance(template, str):
        return "several named chat templates"
    if template is not None and (directory / "chat_template.jinja").is_file():
        return "a chat template in both tokenizer_config.json and chat_template.jinja"
    if (directory / "additional_chat_templates").is_dir():
        return "additional named chat templates"
    return None


def _missing_specials(backend: tokenizers.Tokenizer, settings: dict) -> str | None:
    """transformers adds named or extra special tokens missing from the added vocabulary, and
    re-adds config entries that differ from tokenizer.json's: either changes the vocabulary."""
    added = backend.get_added_tokens_decoder()
    contents = {token.content for token in added.values()}
    wanted = [_content(settings[n]) for n in NAMED_SPECIAL if settings.get(n) is not None]
    wanted += [_content(t) for t in settings.get("extra_special_tokens") or settings.get("additional_special_tokens") or []]
    missing = [token for token in wanted if token not in contents]
    if missing:
        return f"special tokens {missing[:3]} are not in tokenizer.json's added tokens"
    for index, entry in (settings.get("added_tokens_decoder") or {}).items():
        token = added.get(int(index))
        entry = entry if isinstance(entry, dict) else {"content": str(entry)}
        if token is None or any(getattr(token, key) != value for key, value in entry.items() if key != "__type"):
            return f"added token {index} differs between tokenizer_config.json and tokenizer.json"
    return None


def read_fast(directory: str | Path) -> tuple[Tokenizer | None, str | None]:
    """Our tokenizer for these files, or (None, why transformers' is needed)."""
    directory = Path(directory)
    settings = _settings(directory)
    problem = fast_path_problem(directory, settings)
    if problem is not None:
        return None, problem
    backend = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    problem = _missing_specials(backend, settings)
    if problem is not None:
        return None, problem
    backend.no_truncation()
    backend.no_padding()
    template = settings.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    return Tokenizer(backend, settings, template, str(directory)), None


def read_tokenizer(directory: str | Path):
    """A checkpoint directory's tokenizer: ours where the files allow (`fast_path_problem`),
    else `transformers`' AutoTokenizer."""
    tokenizer, _ = read_fast(directory)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
