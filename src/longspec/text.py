"""Turning a growing list of token ids into text pieces without re-decoding the
whole output every step (which would cost O(n^2) over a long generation)."""

from __future__ import annotations


class IncrementalDecoder:
    """Decode tokens as they arrive. A piece is released only when it decodes to
    complete characters; two offsets keep the context a tokenizer needs to place
    spaces (SentencePiece-style tokenizers decode a slice differently at its start)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token: int) -> str:
        self.tokens.append(token)
        decode = self.tokenizer.decode
        prefix_text = decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new_text = decode(self.tokens[self.prefix_offset :], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return new_text[len(prefix_text) :]
        return ""
