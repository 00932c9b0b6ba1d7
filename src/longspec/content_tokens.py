"""Tokenizing text someone else wrote: control-token strings inside it (Gemma's
`<end_of_turn>`, `<start_of_turn>model`, `<eos>`) become the plain tokens that spell
them, so a message cannot close its turn and forge the assistant's; the chat
template's own control tokens and the BOS the tokenizer adds stay special.

How: HF tokenizers read `split_special_tokens=True` as "match no special token in
this text". A chat is rendered once with the real contents and once with a marker
in place of each (to learn where the contents lie); the rendered text is then cut
only at the special tokens that lie wholly in the template's own text, and each piece
between them is tokenized with special tokens split. Where no content holds a
control-token string, that is exactly the ordinary tokenization, which is used as is.
"""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Sequence

_PATTERNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def special_strings(tokenizer) -> re.Pattern | None:
    """A pattern of the tokenizer's special tokens' strings (longest first, as the
    tokenizer matches them), or None when it has none. Built once per tokenizer."""
    if tokenizer not in _PATTERNS:
        strings = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content},
                         key=len, reverse=True)
        _PATTERNS[tokenizer] = re.compile("|".join(map(re.escape, strings))) if strings else None
    return _PATTERNS[tokenizer]


def encode_text(tokenizer, text: str, *, special_tokens: bool) -> list[int]:
    """A prompt's token ids (with the BOS and the like the tokenizer adds); special-token
    strings in `text` are read as control tokens only when `special_tokens`."""
    return list(tokenizer(text, split_special_tokens=not special_tokens).input_ids)


def encode_chat(tokenizer, messages: Sequence[dict], *, special_tokens: bool) -> list[int]:
    """A conversation in the tokenizer's chat template, ending where the assistant's
    reply begins; with `special_tokens` False, control-token strings in the messages'
    fields (all but the role) are plain text."""
    pattern = special_strings(tokenizer)
    if special_tokens or pattern is None or not any(pattern.search(v) for v in _contents(messages)):
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text, content_spans = _rendered_with_spans(tokenizer, messages)
    ids: list[int] = []
    start = 0
    for match in pattern.finditer(text):
        if any(s < match.end() and match.start() < e for s, e in content_spans):
            continue  # inside (or across) a message's own text: plain tokens
        ids += _plain(tokenizer, text[start : match.start()])
        ids.append(tokenizer.convert_tokens_to_ids(match.group()))
        start = match.end()
    return ids + _plain(tokenizer, text[start:])


def _plain(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)


def _contents(messages: Sequence[dict]) -> list[str]:
    return [value for message in messages for key, value in message.items() if key != "role" and isinstance(value, str)]


def _rendered_with_spans(tokenizer, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and where each message field's text lies in it. Rendered again
    with a marker per field; the marked rendering, with each marker replaced by its
    field's text (or that text trimmed, as templates often `| trim` it), must give the
    real one, else the template reshapes the contents in a way that cannot be followed
    and the request is refused."""
    nonce = secrets.token_hex(8)
    fields: list[str] = []
    marked = []
    for message in messages:
        copy = dict(message)
        for key, value in message.items():
            if key != "role" and isinstance(value, str):
                copy[key] = f"\ue000{nonce}:{len(fields)}\ue001"
                fields.append(value)
        marked.append(copy)
    real = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    template = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", template)  # template text, field index, template text, ...
    spans, position = [], 0
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if not real.startswith(piece, position):
                break
            position += len(piece)
            continue
        following = pieces[i + 1]
        value = fields[int(piece)]
        fits = [v for v in (value, value.strip()) if real.startswith(v + following, position)]
        if not fits:
            break
        spans.append((position, position + len(fits[0])))
        position += len(fits[0])
    else:
        if position == len(real):
            return real, spans
    raise ValueError("a message holds a control-token string (such as the template's turn markers) and this chat "
                     "template reshapes message text in a way that cannot keep it plain text: remove the "
                     "control-token strings from the messages (or, for a trusted caller, read them as control "
                     "tokens: special_tokens=True in Python, `longspec serve --allow-special-tokens`)")
