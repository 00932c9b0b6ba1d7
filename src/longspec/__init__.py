"""longspec: lossless speculative decoding for long prompts and long outputs."""
__version__ = "0.1.0"
