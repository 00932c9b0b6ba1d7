"""LongSpec/GLIDE draft trainer: target features on the fly (or from a feature
cache), Anchor-Offset Indices, flash-noisy or block-wise visibility, chunked
cross-entropy over the shared head, AdamW + cosine, resumable checkpoints.

Runs in one process, or unchanged under `torchrun`/`accelerate launch`: when
torch.distributed is initialised (WORLD_SIZE > 1) the draft is wrapped in DDP and
rank r takes its own rows of every step's batch.

Determinism (what makes resume exact): a step's randomness (noisy shift) comes
from a generator seeded by (seed, step); a row's anchor offset from (seed, row);
the data order from (seed, epoch). The checkpoint stores weights, optimizer and
scheduler state, the step and the data position, and nothing else is needed.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file

from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.speculation.drafters.longspec.checkpoint import config_path, draft_config_json, draft_tensors, load_draft
from longspec.speculation.drafters.longspec.config import DraftConfig
from longspec.speculation.drafters.longspec.model import DraftModel, chunked_cross_entropy, cross_attention_bias, target_rope
from longspec.training.data import SequenceSampler, most_frequent_ids
from longspec.training.fingerprint import target_fingerprint, tokens_fingerprint
from longspec.training.longspec.features import FEATURES_VERSION, IGNORE, FeatureCache, target_features
from longspec.training.longspec.warm_start import warm_start_from_target
from longspec.training.longspec.visibility import NoisyShift, anchor_offset_positions
from longspec.training.resumable import RUN_CONTROL, ResumableTrainer

WEIGHTS_NAME = "draft.safetensors"


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 1000
    seq_len: int = 512
    batch_size: int = 4  # sequences per step per process
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    anchor_offset: bool = True
    self_distill: bool = True  # labels = the target's greedy predictions (else the data's next tokens)
    loss_chunk: int = 256
    bf16_autocast: bool = False  # draft matmuls in bfloat16 (fast on CPU); weights and optimizer stay float32
    seed: int = 0
    save_every: int = 50
    visibility: object = field(default_factory=lambda: NoisyShift(5))
    # Ids every row starts with, as every served prompt does (the tokenizer's BOS; see
    # data.served_prefix). Their labels never count: the first query sees no target key.
    row_prefix: tuple[int, ...] = ()
    # Rows one epoch visits (a seeded sample of the stream; None: all). Fewer rows with
    # cached features make later epochs cost only the draft's own steps.
    max_rows: int | None = None

    def describe(self) -> dict:
        data = asdict(self)
        data["visibility"] = f"{type(self.visibility).__name__}({vars(self.visibility)})"
        return data


class LongSpecTrainer(ResumableTrainer):
    progress_label = "train longspec"

    def __init__(
        self,
        target: Decoder,
        train_tokens: torch.Tensor,
        out_dir: str | Path,
        options: TrainOptions,
        *,
        draft_config: DraftConfig | None = None,
        draft_vocab: int | None = None,
        feature_cache: str | Path | None = None,
        init_from: str | Path | None = None,
        warm_start: bool = False,
        progress: bool = True,
    ) -> None:
        self.target = target
        self.device = target.device  # the draft, its features and its loss live with the target
        self.options = options
        self.out = Path(out_dir)
        self.progress = progress
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.sampler = SequenceSampler(train_tokens, options.seq_len, options.seed, options.row_prefix, options.max_rows)
        weights = self.out / WEIGHTS_NAME
        # What the run trains on: a resume with another target, corpus or options is refused.
        inputs = {"trainer": "longspec", "target": target_fingerprint(target), "tokens": tokens_fingerprint(train_tokens),
                  "options": {k: v for k, v in options.describe().items() if k not in RUN_CONTROL},
                  "draft_config": draft_config.to_dict() if draft_config is not None else None,
                  "draft_vocab": draft_vocab, "init_from": str(init_from) if init_from is not None else None,
                  "warm_start": warm_start}
        resume = self._resume_point(inputs)
        with torch.device(HOST):  # built on the host, then moved to the target's device
            if resume:
                self.draft = load_draft(weights, target.config).requires_grad_(True).train()
            elif init_from is not None:
                # Continue training an existing draft (its config and vocabulary) with a
                # fresh optimizer and schedule: how a shipped draft grows with more data.
                if draft_config is not None or draft_vocab is not None or warm_start:
                    raise ValueError("init_from takes the draft's architecture and vocabulary from that checkpoint; "
                                     "drop draft_config/draft_vocab/warm_start (or start from scratch without init_from)")
                self.draft = load_draft(init_from, target.config).requires_grad_(True).train()
            else:
                config = draft_config or DraftConfig.for_target(target.config)
                if draft_vocab is not None:
                    config = DraftConfig.from_dict({**config.to_dict(), "draft_vocab_size": draft_vocab})
                self.draft = DraftModel(config).reset_parameters(options.seed)
                if warm_start:
                    warm_start_from_target(self.draft, target)
                if draft_vocab is not None:
                    eos = [t for t in target.config.eos_token_ids if t < target.config.vocab_size]
                    self.draft.vocab_ids.copy_(most_frequent_ids(train_tokens, target.config.vocab_size, draft_vocab, eos))
        self.draft.to(self.device)
        config = self.draft.config
        self.cache = FeatureCache(feature_cache, key={
            "features": FEATURES_VERSION, "target": target_fingerprint(target), "layers": list(config.target_layers), "seq_len": options.seq_len,
            "seed": options.seed, "row_prefix": list(options.row_prefix), "tokens": tokens_fingerprint(train_tokens),
        })
        head_dtype = torch.bfloat16 if options.bf16_autocast else torch.float32
        self.head_rows = self.draft.head_rows(target.head_weight).to(head_dtype)
        self.label_map = torch.full((config.vocab_size,), IGNORE, dtype=torch.long, device=self.device)
        ids = self.draft.vocab_ids if self.draft.reduced_vocab else torch.arange(config.vocab_size, device=self.device)
        self.label_map[ids] = torch.arange(ids.numel(), device=self.device)
        self._prepare_optimization(self.draft, options, resume=resume)

    # ------------------------------------------------------------------ loop
    @property
    def trained_module(self):
        return self.draft

    def train_step(self) -> tuple[float, int]:
        opts = self.options
        generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + self.step)
        visible, counted = opts.visibility.mask(opts.seq_len, generator)  # drawn on the host: same on every device
        visible, counted = visible.to(self.device), counted.to(self.device)
        cross_mask = visible.clone()
        cross_mask[~counted, 0] = True  # rows with nothing to see: a dummy key, excluded from the loss
        first = self.position + self.rank * opts.batch_size
        rows = [self.sampler.row_at(first + i) for i in range(opts.batch_size)]
        batch = [self._features(row) for row in rows]
        labels = [self.label_map[f["labels"]].masked_fill(~counted, IGNORE) for f in batch]
        total = sum(int((y != IGNORE).sum()) for y in labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for i, (features, y) in enumerate(zip(batch, labels)):
            sync = i == len(batch) - 1 or self.world == 1
            context = contextlib.nullcontext() if sync else self.model.no_sync()
            with context:
                loss = self._row_loss(features, y, cross_mask, visible) / max(total, 1)
                loss.backward()
            loss_sum += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), opts.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return loss_sum, total

    def _features(self, row: int) -> dict[str, torch.Tensor]:
        opts = self.options
        ids = self.sampler.sequences[row]
        positions = self.row_positions(row)
        key = f"row{row}-{'self' if opts.self_distill else 'data'}-{'aoi' if opts.anchor_offset else 'plain'}"
        features = self.cache.get_or_compute(
            key, lambda: target_features(self.target, ids, positions, self.draft.config.target_layers, opts.self_distill)
        )
        on_device = {name: tensor.to(self.device) for name, tensor in features.items()}
        return {**on_device, "ids": ids.to(self.device), "positions": positions.to(self.device)}

    def row_positions(self, row: int) -> torch.Tensor:
        n = self.options.seq_len
        if not self.options.anchor_offset:
            return torch.arange(n, device=HOST)
        generator = torch.Generator().manual_seed(self.options.seed * 7919 + row)
        return anchor_offset_positions(n, self.target.config.max_position_embeddings, generator)

    def _row_loss(self, features, labels, cross_mask, visible) -> torch.Tensor:
        opts = self.options
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if opts.bf16_autocast else contextlib.nullcontext()
        with autocast:
            hidden = training_hidden(self.model, self.draft.config, self.target, features, cross_mask, visible)
            keep = labels != IGNORE
            return chunked_cross_entropy(
                hidden[keep], self.head_rows, labels[keep], chunk=opts.loss_chunk, cap=self.target.config.final_logit_softcapping
            )

    # ------------------------------------------------------------ checkpoints
    def save(self) -> None:
        if self.rank != 0:
            return
        meta = {"step": self.step, "options": self.options.describe()}
        weights = self.out / WEIGHTS_NAME
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step,
                 "position": self.position}
        self._commit({weights.name: lambda path: save_file(draft_tensors(self.draft), str(path)),
                      config_path(weights).name: lambda path: path.write_text(draft_config_json(self.draft, meta))}, state)


def training_hidden(model, config: DraftConfig, target: Decoder, features: dict, cross_mask: torch.Tensor,
                    visible: torch.Tensor | None = None) -> torch.Tensor:
    """Draft hidden states [n, H] for one training row: self-attention causal within
    the window (by RoPE position), cross-attention onto the row's target K/V under
    `cross_mask` [n, n] (query index x key index). `visible`: the visibility without
    the dummy keys that rows seeing nothing get in `cross_mask` (default: cross_mask);
    it picks the EAGLE-style hidden input. `model` may be DDP-wrapped."""
    positions = features["positions"]
    dtype = next(model.parameters()).dtype
    x = target.embed(features["ids"].unsqueeze(0)).to(dtype)
    rope = target_rope(target, positions, dtype)
    distance = positions.unsqueeze(1) - positions.unsqueeze(0)
    self_mask = (distance >= 0) & (distance < config.window)
    scale = target.config.attention_scale
    target_hidden = None
    if config.hidden_input:
        target_hidden = newest_visible_hidden(features["hidden"], cross_mask if visible is None else visible)
        target_hidden = target_hidden.to(dtype).unsqueeze(0)

    def attend_self(m, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask, scale=config.self_head_dim ** -0.5)

    bias = None
    if config.cross_attention_masked:
        bias = cross_attention_bias(config, positions, positions, cross_mask, torch.float64)
        # Rows that see no key keep the dummy key cross_mask gave them (they are not in the loss).
        bias[:, ~torch.isfinite(bias).any(dim=-1).any(dim=0), 0] = 0.0
        bias = bias.to(dtype)

    def attend_cross(m, q):
        k, v = features[f"k{m}"].to(q.dtype), features[f"v{m}"].to(q.dtype)
        mask = cross_mask if bias is None else bias.to(q.dtype).unsqueeze(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    return model(x, positions, rope, attend_self, attend_cross, target_hidden=target_hidden)[0]


def newest_visible_hidden(hidden: torch.Tensor, cross_mask: torch.Tensor) -> torch.Tensor:
    """[n, H]: for each query, the target's hidden state at the newest key index it may
    see under `cross_mask` [n, n] (zeros where it sees none) — what inference hands a
    draft node: the state of the last committed token."""
    index = torch.arange(cross_mask.shape[1], device=cross_mask.device)
    newest = torch.where(cross_mask, index, -1).amax(dim=1)
    picked = hidden[newest.clamp(min=0)]
    return picked.masked_fill((newest < 0).unsqueeze(1), 0.0)
