"""The real shapes the random-weight GGUF files take (the published configs of each model;
rope scaling and sliding windows left out: both engines then run plain RoPE)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    architecture: str  # the GGUF `general.architecture` (llama.cpp's and transformers' name)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    special_tokens: int  # control tokens at the end of the vocabulary, as the real file has
    tied: bool  # the output layer reads the token embedding (no output.weight)
    qkv_bias: bool
    rope_theta: float
    rms_eps: float
    pre_tokenizer: str  # `tokenizer.ggml.pre`: the split both llama.cpp and transformers know
    add_bos: bool

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.ffn
        head = 0 if self.tied else self.vocab * self.hidden
        return self.layers * (attention + mlp) + self.vocab * self.hidden + head


SHAPES = {
    "llama-3.2-1b": Shape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 256, True, False,
                          500000.0, 1e-5, "llama-bpe", True),
    "llama-3.2-3b": Shape("llama-3.2-3b", "llama", 3072, 28, 24, 8, 128, 8192, 128256, 256, True, False,
                          500000.0, 1e-5, "llama-bpe", True),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, 293, True, True,
                          1000000.0, 1e-6, "qwen2", False),
    "llama-3.1-8b": Shape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 256, False, False,
                          500000.0, 1e-5, "llama-bpe", True),
}
