"""What an output constraint may weigh, and whether any text satisfies it: both
checked before any work, so that a request the matcher cannot follow is refused
with the limit and the fix instead of failing mid-generation or returning text that
breaks the constraint.

Why these bounds: llguidance's Earley parser refuses a row past 2,000 items, and an
object with ~500 optional properties fills one row (each optional key is a few
items); building a matcher also costs ~1 s per 100 KB of schema on the server.
"""

from __future__ import annotations

import json

MAX_SPEC_BYTES = 64 << 10  # a schema's JSON, a grammar's or regex's text, the choices' JSON
MAX_OBJECT_PROPERTIES = 256  # in one object of a JSON schema (properties + patternProperties)


class ConstraintTooLarge(ValueError):
    """A constraint past MAX_SPEC_BYTES or MAX_OBJECT_PROPERTIES."""


class EmptyLanguage(ValueError):
    """A constraint no text satisfies."""


def check_size(kind: str, spec: object) -> None:
    """Refuse a constraint past the bounds above, naming the bound and what to do."""
    what = kind.replace("_", " ")
    text = spec if isinstance(spec, str) else json.dumps(spec)
    size = len(text.encode("utf-8"))
    if size > MAX_SPEC_BYTES:
        raise ConstraintTooLarge(f"the {what} is {size:,} bytes, more than the limit of {MAX_SPEC_BYTES:,}: "
                                 "split the output into several requests, or move fixed text into the prompt")
    if kind == "json_schema":
        widest = _widest_object(json.loads(spec) if isinstance(spec, str) else spec)
        if widest > MAX_OBJECT_PROPERTIES:
            raise ConstraintTooLarge(
                f"the json schema has an object with {widest:,} properties, more than the limit of "
                f"{MAX_OBJECT_PROPERTIES}: group them into nested objects, or ask for an array of key/value items")


def _widest_object(schema: object) -> int:
    """The most properties any one object of the schema declares (walked without
    recursion: a request's schema may be deep)."""
    widest, pending = 0, [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            count = sum(len(node[key]) for key in ("properties", "patternProperties")
                        if isinstance(node.get(key), dict))
            widest = max(widest, count)
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return widest


def check_not_empty(kind: str, grammar: str) -> None:
    """Refuse a grammar whose language is empty (`[^\\s\\S]`, a `$ref` to itself): at its
    start a matcher over single bytes allows no byte and does not accept the empty text.
    (A grammar whose every text is infinite still starts; it ends at max_tokens.)"""
    import llguidance
    import llguidance.numpy

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    bitmask = llguidance.numpy.allocate_token_bitmask(1, _BYTES + 1)
    if not matcher.is_error():
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
    starts = not matcher.is_error() and (bool(bitmask[0, : _BYTES // 32].any()) or matcher.is_accepting())
    if not starts:
        raise EmptyLanguage(f"the {kind.replace('_', ' ')} matches no text at all (its language is empty: a "
                            "character class with nothing in it, a $ref or rule that only refers to itself): "
                            "give it at least one text it accepts")


_BYTES = 256
_BYTE_TOKENIZER = None


def _byte_tokenizer():
    """An llguidance tokenizer of the 256 bytes and an EOS, built once (milliseconds)."""
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        import llguidance

        _BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
    return _BYTE_TOKENIZER


class _Bytes:
    eos_token_id = _BYTES
    bos_token_id = None
    special_token_ids = [_BYTES]
    tokens = [bytes([b]) for b in range(_BYTES)] + [b""]

    def __call__(self, text) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)
