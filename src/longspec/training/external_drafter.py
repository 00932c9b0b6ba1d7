"""Training an external drafter — a small Mamba (state-space) or transformer causal LM
that shares the target's tokenizer — for `method="mamba"` / `method="draft-model"`.

Rows look like served sequences (the served prefix, e.g. BOS, first; its label never
counts). Labels are the target's own greedy next tokens (self-distillation: the
drafter learns what the target will accept) or the corpus's next tokens. The drafter
speaks a reduced vocabulary (`VocabMap`: the most frequent corpus tokens plus one
"other" id), so its embedding and output layer stay small beside a 262k-token target
vocabulary; verification stays exact over the full vocabulary.

A run directory holds the drafter as `transformers` saves it (config.json,
model.safetensors) with its `longspec-vocab.json` — exactly what the drafters load —
plus trainer_state.pt and loss.csv. Rerunning resumes: the sequence order is derived
from (seed, epoch) and the step, so a resumed run ends at the weights of an
uninterrupted one. Under `accelerate launch` / `torchrun` each rank takes its own
rows of every batch (DDP).
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from longspec.runtime.device import HOST
from longspec.runtime.model import Decoder
from longspec.speculation.drafters.shared.vocab_map import FILE_NAME as VOCAB_FILE
from longspec.speculation.drafters.shared.vocab_map import VocabMap
from longspec.training.data import SequenceSampler, most_frequent_ids
from longspec.training.fingerprint import target_fingerprint, tokens_fingerprint
from longspec.training.longspec.features import IGNORE, FeatureCache
from longspec.training.resumable import RUN_CONTROL, ResumableTrainer

WEIGHTS_NAME = "model.safetensors"  # what `save_pretrained` writes
LABELS_VERSION = 1


@dataclass(frozen=True)
class DrafterTrainOptions:
    steps: int = 1000
    seq_len: int = 512
    batch_size: int = 8  # sequences per step per process
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    self_distill: bool = True  # labels = the target's greedy predictions (else the corpus's next tokens)
    seed: int = 0
    save_every: int = 50
    row_prefix: tuple[int, ...] = ()  # the served prefix every row starts with; its labels never count
    max_rows: int | None = None  # rows one epoch visits (a seeded sample; None: all)


def reduced_vocabulary(train_tokens: torch.Tensor, target_config, size: int) -> VocabMap:
    """The `size` most frequent training tokens (the target's EOS ids always among them)."""
    eos = [t for t in target_config.eos_token_ids if t < target_config.vocab_size]
    if size <= len(eos):
        raise ValueError(f"a reduced vocabulary of {size} tokens leaves no room beside the EOS ids {eos}")
    return VocabMap(most_frequent_ids(train_tokens, target_config.vocab_size, size, eos), target_config.vocab_size)


class ExternalDrafterTrainer(ResumableTrainer):
    progress_label = "train drafter"

    def __init__(
        self,
        model: torch.nn.Module,
        target: Decoder,
        vocab: VocabMap,
        train_tokens: torch.Tensor,
        out_dir: str | Path,
        options: DrafterTrainOptions,
        *,
        label_cache: str | Path | None = None,
        forward_module: torch.nn.Module | None = None,
        progress: bool = True,
    ) -> None:
        """model: a freshly built `transformers` causal LM over `vocab.draft_vocab_size`
        ids (its weights are replaced by the run's when `out_dir` holds one).
        forward_module: what a step calls for the logits, `(input_ids=...) -> .logits`,
        computing them from `model`'s parameters (e.g. `MambaSequenceLM(model)`, the
        native scan); default `model` itself."""
        if model.config.vocab_size < vocab.draft_vocab_size:
            raise ValueError(f"the drafter has {model.config.vocab_size} ids; its vocabulary needs {vocab.draft_vocab_size}")
        self.target = target
        self.device = target.device
        self.vocab = vocab.to(self.device)
        self.options = options
        self.out = Path(out_dir)
        self.progress = progress
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.sampler = SequenceSampler(train_tokens, options.seq_len, options.seed, options.row_prefix, options.max_rows)
        self.drafter = model.to(device=self.device, dtype=torch.float32).train()
        weights = self.out / WEIGHTS_NAME
        # What the run trains on: a resume with another target, corpus, drafter or options is refused.
        inputs = {"trainer": "external", "target": target_fingerprint(target), "tokens": tokens_fingerprint(train_tokens),
                  "options": {k: v for k, v in asdict(options).items() if k not in RUN_CONTROL},
                  "architecture": model.config.to_dict(), "vocab": vocab.target_ids.tolist()}
        resume = self._resume_point(inputs)
        if resume:
            from safetensors.torch import load_file

            saved = VocabMap.load(self.out)
            if saved is None or not torch.equal(saved.target_ids, vocab.target_ids):
                raise ValueError(f"{self.out} holds a drafter with another vocabulary; use another --out to start over")
            result = self.drafter.load_state_dict(load_file(str(weights), device=str(self.device)), strict=False)
            tied = {"lm_head.weight"} if self.drafter.config.tie_word_embeddings else set()
            if set(result.missing_keys) - tied or result.unexpected_keys:
                raise ValueError(f"{weights} does not match the drafter's architecture (missing "
                                 f"{sorted(set(result.missing_keys) - tied)}, unexpected {sorted(result.unexpected_keys)})")
        self.labels = FeatureCache(label_cache, key={
            "labels": LABELS_VERSION, "target": target_fingerprint(target), "seq_len": options.seq_len,
            "row_prefix": list(options.row_prefix), "tokens": tokens_fingerprint(train_tokens),
        }) if options.self_distill else None
        forward_module = self.drafter if forward_module is None else forward_module.to(self.device, torch.float32)
        if {id(p) for p in forward_module.parameters()} != {id(p) for p in self.drafter.parameters()}:
            raise ValueError("forward_module must compute the logits from the drafter's own parameters")
        self._prepare_optimization(forward_module, options, resume=resume)

    # ------------------------------------------------------------------ loop
    @property
    def trained_module(self):
        return self.drafter

    def train_step(self) -> tuple[float, int]:
        opts = self.options
        first = self.position + self.rank * opts.batch_size
        rows = [self.sampler.row_at(first + i) for i in range(opts.batch_size)]
        ids = self.sampler.sequences[torch.tensor(rows, device=HOST)]  # [B, L] target ids
        labels = torch.stack([self._labels(row, ids[i]) for i, row in enumerate(rows)])
        labels[:, : len(opts.row_prefix)] = IGNORE  # served prompts never end inside the prefix
        inputs = self.vocab.to_draft(ids)
        labels = labels.to(self.device)
        targets = torch.where(labels == IGNORE, IGNORE, self.vocab.to_draft(labels.clamp(min=0)))
        logits = self.model(input_ids=inputs).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), opts.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        return float(loss.detach()), int((targets != IGNORE).sum())

    def _labels(self, row: int, ids: torch.Tensor) -> torch.Tensor:
        """[L] target ids: label t is the token after position t (IGNORE where unknown)."""
        if not self.options.self_distill:
            return torch.cat([ids[1:], torch.tensor([IGNORE], device=HOST)])
        features = self.labels.get_or_compute(f"row{row}", lambda: {"labels": self._target_greedy(ids)})
        return features["labels"].to(HOST)

    @torch.inference_mode()
    def _target_greedy(self, ids: torch.Tensor) -> torch.Tensor:
        cache = self.target.new_cache(ids.numel(), max_forward_tokens=ids.numel())
        out = self.target(ids.unsqueeze(0), cache, with_logits=False)
        return self.target.greedy_tokens(out.hidden[0]).to(HOST).clone()

    # ------------------------------------------------------------ checkpoints
    def save(self) -> None:
        if self.rank != 0:
            return
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(), "step": self.step,
                 "position": self.position, "options": asdict(self.options)}
        # `transformers` writes the model's files; they join the checkpoint as one unit.
        with tempfile.TemporaryDirectory(dir=self.out.parent if self.out.parent.exists() else None) as scratch:
            scratch = Path(scratch)
            self.drafter.save_pretrained(scratch, safe_serialization=True)
            self.vocab.to(HOST).save(scratch)
            writers = {f.name: (lambda path, f=f: shutil.copyfile(f, path)) for f in sorted(scratch.iterdir()) if f.is_file()}
            self._commit(writers, state)


def cut_vocabulary(model, vocab: VocabMap, frequencies: torch.Tensor, keep: int, always: list[int]) -> VocabMap:
    """Cut a trained drafter (embedding tied to its output layer) to the `keep` most
    frequent of its tokens by `frequencies` [target vocabulary] (and `always`, e.g.
    EOS): the embedding rows of the rest go, the "other" id's row stays (last). Returns
    the new vocabulary; a target token outside it reads as "other" and is never
    proposed. For shipping a smaller drafter."""
    if not model.config.tie_word_embeddings:
        raise ValueError("cutting the vocabulary expects an output layer tied to the embedding")
    if not 0 < keep < vocab.other:
        raise ValueError(f"keep must be in [1, {vocab.other}), got {keep}")
    ranked = frequencies[vocab.target_ids].double()
    listed = vocab.to_draft(torch.tensor(list(always), dtype=torch.long))
    ranked[listed[listed != vocab.other]] = float("inf")
    kept = ranked.argsort(descending=True, stable=True)[:keep].sort().values  # draft ids, ascending target order
    rows = torch.cat([kept, torch.tensor([vocab.other])])
    embedding = model.get_input_embeddings()
    embedding.weight.data = embedding.weight.data[rows].clone()
    embedding.num_embeddings = rows.numel()
    model.config.vocab_size = rows.numel()
    model.tie_weights()
    return VocabMap(vocab.target_ids[kept], vocab.target_vocab_size)


def check_initial_drafter(directory: str | Path, architecture: str) -> None:
    """Before any weights load: `directory` holds a drafter as training writes it (the
    model as `transformers` saves it, with its vocabulary map), of `architecture`
    ("mamba" or "draft-model")."""
    from transformers import AutoConfig

    directory = Path(directory)
    missing = [name for name in ("config.json", WEIGHTS_NAME, VOCAB_FILE) if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(f"--init-from {directory} is not a trained drafter (no {', '.join(missing)}); pass the "
                                "directory `longspec train mamba|draft-model --out` wrote, or a shipped drafter's")
    model_type = AutoConfig.from_pretrained(str(directory), local_files_only=True).model_type
    if (model_type == "mamba") != (architecture == "mamba"):
        other = "mamba" if model_type == "mamba" else "draft-model"
        raise ValueError(f"--init-from {directory} holds a {model_type} model: continue it with `longspec train {other}`")


def initial_drafter(directory: str | Path, architecture: str, target_config) -> tuple[torch.nn.Module, VocabMap]:
    """A trained drafter to continue (float32) and its vocabulary, refused with the
    reason when it is not of `architecture` or does not fit the target's vocabulary."""
    from transformers import AutoModelForCausalLM

    check_initial_drafter(directory, architecture)
    vocab = VocabMap.load(directory)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, local_files_only=True)
    vocab.check_fits("drafter of --init-from", model.config.vocab_size, target_config)
    return model, vocab


def mamba_drafter(vocab: VocabMap, *, hidden_size: int = 256, layers: int = 8, state_size: int = 16, seed: int = 0):
    """A fresh `transformers` Mamba over the drafter's reduced vocabulary (seeded initialisation)."""
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=vocab.draft_vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                         state_size=state_size, pad_vocab_size_multiple=1, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return _seeded(lambda: MambaForCausalLM(config), seed)


def transformer_drafter(vocab: VocabMap, target_config, *, hidden_size: int = 256, layers: int = 4, heads: int = 4,
                        kv_heads: int = 2, intermediate_size: int = 768, seed: int = 0):
    """A fresh small Llama over the drafter's reduced vocabulary and the target's context
    (our runtime runs it as `method="draft-model"`; seeded initialisation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab.draft_vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden_size // heads,
                         intermediate_size=intermediate_size, max_position_embeddings=target_config.max_position_embeddings,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return _seeded(lambda: LlamaForCausalLM(config), seed)


def _seeded(build, seed: int):
    with torch.random.fork_rng(devices=[]), torch.device(HOST):
        torch.manual_seed(seed)
        return build()


