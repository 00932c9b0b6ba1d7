"""TokenSwift multi-token heads: γ chained residual heads on the frozen target.

    h_0 = x / rms(x), x the target's last hidden state before its final norm
    h_i = f_i(h_{i-1}) + h_{i-1}          (f_i: one linear layer, i = 1..γ)
    logits_i = lm_head(final_norm(h_i))   (the target's own norm and head)

The runtime exposes the *normed* hidden state final_norm(x) = x / rms(x) * s (s the
norm's elementwise scale: 1 + w for Gemma, w otherwise); dividing by s recovers
h_0 exactly, and since RMSNorm ignores the input's scale, final_norm(h_0) is the
target's own normed state: heads with f_i = 0 (the initialisation) predict what
the target head predicts, a sane start for training.

With the target's own head on h_0, one forward yields γ + 1 distributions: for the
next token (target), and for the tokens 2..γ+1 ahead (heads 1..γ).

The heads own only the γ linear layers; the norm and LM head stay the target's, so
a checkpoint is small (γ·H·(H+1) numbers) and fits only targets with the same
hidden size and vocabulary, which `load` checks against a small saved config.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from longspec.runtime.device import HOST

FORMAT = "longspec-tokenswift-heads/1"


@dataclass(frozen=True)
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 3  # γ
    target: str = ""  # free-form description of the target the heads were trained on
    # True: TokenSwift's residual chain, h_i = h_(i-1) + f_i(h_(i-1)); False: Medusa's
    # independent heads, h_i = h_0 + f_i(h_0) (TokenSwift's "Medusa*" ablation).
    chained: bool = True

    def check_fits(self, target_config) -> None:
        problems = []
        if self.hidden_size != target_config.hidden_size:
            problems.append(f"hidden size {self.hidden_size} != target's {target_config.hidden_size}")
        if self.vocab_size != target_config.vocab_size:
            problems.append(f"vocabulary {self.vocab_size} != target's {target_config.vocab_size}")
        if problems:
            raise ValueError(
                "TokenSwift heads do not fit this target (" + "; ".join(problems) + f"; trained on {self.target!r}); "
                "train heads for this target with `longspec train tokenswift --model ...`"
            )


def norm_scale(target) -> torch.Tensor:
    """The elementwise scale s of the target's final RMSNorm (1 + w or w)."""
    norm = target.final_norm
    weight = norm.weight.to(torch.float64)
    return 1.0 + weight if norm.gemma else weight


class TokenSwiftHeads(nn.Module):
    def __init__(self, config: HeadsConfig) -> None:
        super().__init__()
        if config.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {config.num_heads}")
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList(nn.Linear(H, H) for _ in range(config.num_heads))
        for layer in self.layers:  # start as identity heads: h_i = h_0
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    @classmethod
    def for_target(cls, target_config, num_heads: int = 3, target: str = "", chained: bool = True) -> "TokenSwiftHeads":
        return cls(HeadsConfig(target_config.hidden_size, target_config.vocab_size, num_heads, target, chained))

    def randomize(self, generator: torch.Generator, scale: float = 0.5) -> "TokenSwiftHeads":
        """Random weights (tests: losslessness must hold for any heads)."""
        with torch.no_grad():
            for layer in self.layers:
                H = layer.weight.shape[1]
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=generator, device=generator.device) * scale / H**0.5)
                layer.bias.copy_(torch.randn(layer.bias.shape, generator=generator, device=generator.device) * scale)
        return self

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., γ, H]: h_1..h_γ (before the target's final norm)."""
        out = []
        h = h0
        for layer in self.layers:
            base = h if self.config.chained else h0
            h = layer(base) + base
            out.append(h)
        return torch.stack(out, dim=-2)

    def hidden_states(self, target, normed: torch.Tensor) -> torch.Tensor:
        """[..., γ, H] h_1..h_γ from the target's final-norm hidden states [..., H]."""
        dtype = self.layers[0].weight.dtype
        return self(normed.to(dtype) / norm_scale(target).to(dtype))

    def logits(self, target, normed: torch.Tensor) -> torch.Tensor:
        """[..., γ, V] logits of heads 1..γ through the target's final norm and LM head."""
        return target.logits(target.final_norm(self.hidden_states(target, normed).to(target.dtype)))

    # ----------------------------------------------------------------- files
    def save(self, path: str | Path) -> None:
        tensors = {k: v.detach().to(device=HOST, dtype=torch.float32).contiguous() for k, v in self.state_dict().items()}
        meta = {"format": FORMAT, "config": json.dumps(asdict(self.config))}
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, target_config=None, dtype: torch.dtype = torch.float32) -> "TokenSwiftHeads":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"TokenSwift heads file not found: {path}")
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a TokenSwift heads file (format {meta.get('format')!r}, expected {FORMAT!r})")
        config = HeadsConfig(**json.loads(meta["config"]))
        if target_config is not None:
            config.check_fits(target_config)
        heads = cls(config)
        heads.load_state_dict(load_file(str(path)))
        return heads.to(dtype).requires_grad_(False)
