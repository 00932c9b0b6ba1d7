"""A synthetic byte-level BPE vocabulary of a model's exact size, which llama.cpp
(`tokenizer.ggml.model = gpt2`) and transformers' GGUF tokenizer both load: the 256
byte symbols, every pair of them, then byte triples, each merge joining two tokens
already in the vocabulary, and the control tokens at the end (BOS, EOS, reserved)."""

from __future__ import annotations

import string
from dataclasses import dataclass

NORMAL, CONTROL = 1, 3  # llama.cpp's token types


def byte_symbols() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes (space is 'Ġ'), in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def merge_order(symbols: list[str]) -> list[str]:
    """Letters, the space symbol and digits first, so that merges fire on ordinary text."""
    first = [c for c in string.ascii_lowercase + "Ġ" + string.ascii_uppercase + string.digits + ".,'\"-"
             if c in symbols]
    return first + [s for s in symbols if s not in first]


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos: int
    eos: int


def synthetic_vocabulary(size: int, special: int) -> Vocabulary:
    symbols = byte_symbols()
    normal = size - special
    if normal < 256 or special < 2:
        raise ValueError(f"a vocabulary of {size} with {special} control tokens leaves no room for the 256 bytes")
    ordered = merge_order(symbols)
    tokens, merges = list(symbols), []
    pairs = [a + b for a in ordered for b in ordered]
    for pair in pairs:
        if len(tokens) == normal:
            break
        tokens.append(pair)
        merges.append(f"{pair[0]} {pair[1]}")
    for pair in pairs:
        for c in ordered:
            if len(tokens) == normal:
                break
            tokens.append(pair + c)
            merges.append(f"{pair} {c}")
        if len(tokens) == normal:
            break
    if len(tokens) < normal:
        raise ValueError(f"a vocabulary of {normal} normal tokens is beyond byte triples")
    # EOS spelled "<|endoftext|>": transformers' byte-level tokenizer adds that token when absent.
    controls = ["<|begin_of_text|>", "<|endoftext|>"] + [f"<|reserved_special_token_{i}|>"
                                                           for i in range(special - 2)]
    types = [NORMAL] * normal + [CONTROL] * special
    return Vocabulary(tokens + controls, types, merges, bos=normal, eos=normal + 1)
