"""The loop the token-stream trainers share (LongSpec drafts, external drafters):
steps until the step budget, a step limit or a wall-time limit; a checkpoint every
`save_every` steps and when it stops; a loss curve that a resumed run continues
from its checkpoint's step (rows logged after it are dropped)."""

from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from longspec.runtime.atomic_files import Checkpoint, CheckpointError, trim_torn_tail, write_atomically

LOSS_LOG = "loss.csv"
# Options that steer a run without changing what it learns at a step: a resume may change
# them (train further with more steps, save more often); every other option is an input.
RUN_CONTROL = frozenset({"steps", "save_every"})


def cosine_lr(step: int, steps: int, warmup: int, min_lr_ratio: float) -> float:
    """Multiplier of the base learning rate: linear warmup, then cosine to min_lr_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


class ResumableTrainer:
    """Subclasses set `options` (steps, batch_size, save_every, lr, warmup, min_lr_ratio,
    weight_decay), `out`, `device`, `rank`, `world` and `progress`, call
    `_prepare_optimization`, and define `train_step()` -> (loss, counted tokens),
    `save()` and `trained_module`."""

    progress_label = "train"
    state_name = "trainer_state.pt"

    def _resume_point(self, inputs: dict) -> bool:
        """Whether `out` holds a checkpoint to resume from: its files checked against its
        manifest and `inputs` (what the run trains on) against the ones it was trained on
        (`runtime.atomic_files.Checkpoint`; raises CheckpointError naming the difference).
        Call before loading anything from `out`."""
        self.inputs = json.loads(json.dumps(inputs, sort_keys=True, default=str))
        self.checkpoint = Checkpoint(self.out)
        manifest = self.checkpoint.verify(self.inputs)
        if manifest is None and (Path(self.out) / self.state_name).is_file():
            raise CheckpointError(f"{self.out} holds a run without a checkpoint manifest (written by an older "
                                  "version, or damaged): start a new run (another --out)")
        return manifest is not None

    def _commit(self, writers: dict, state: dict) -> None:
        """Write this step's checkpoint (the module's files from `writers`, name -> writer
        of a path, and the optimizer `state`) as one unit."""
        self.checkpoint.commit({**writers, self.state_name: lambda path: torch.save(state, path)}, self.inputs,
                               self.step)

    def _prepare_optimization(self, module, options, resume: bool) -> None:
        """DDP across ranks, AdamW with the cosine schedule, and — when `resume` (the run
        directory holds weights) — the optimizer, schedule, step and data position of the
        last checkpoint. `module` is the trained module (its weights already loaded)."""
        self.model = module
        if self.world > 1:
            device_ids = [self.device] if self.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=options.lr, betas=(0.9, 0.95),
                                           weight_decay=options.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: cosine_lr(s, options.steps, options.warmup, options.min_lr_ratio))
        self.step = 0
        self.position = 0  # sequences consumed, all ranks together
        state_file = Path(self.out) / self.state_name
        if resume and state_file.is_file():
            state = torch.load(state_file, weights_only=True, map_location=self.device)
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.step, self.position = state["step"], state["position"]
        # Rows logged after the checkpoint this run starts from (all of them when a run was
        # killed before its first checkpoint) would be logged again.
        self._truncate_log()

    def train(self, stop_after: int | None = None, max_seconds: float | None = None):
        """Train up to options.steps, or `stop_after` more steps, or until `max_seconds`
        of wall time (a deliberate interruption). Returns the trained module."""
        opts = self.options
        last = opts.steps if stop_after is None else min(opts.steps, self.step + stop_after)
        bar = tqdm(total=last, initial=self.step, desc=self.progress_label, unit="step",
                   disable=not self.progress or self.rank != 0)
        start = time.perf_counter()
        while self.step < last:
            loss, tokens = self.train_step()
            self.step += 1
            self.position += opts.batch_size * self.world
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
            self._log(loss, tokens, time.perf_counter() - start)
            out_of_time = max_seconds is not None and time.perf_counter() - start > max_seconds
            if self.step % opts.save_every == 0 or self.step == last or out_of_time:
                self.save()
            if out_of_time:
                break
        bar.close()
        return self.trained_module

    def _truncate_log(self) -> None:
        """Drop loss rows logged after the checkpoint a resumed run starts from (and a
        row a kill cut off), rewriting the log atomically."""
        path = Path(self.out) / LOSS_LOG
        if self.rank != 0 or not path.is_file():
            return
        trim_torn_tail(path, lambda line: len(line.split(b",")) == 5)
        rows = list(csv.reader(path.open()))
        kept = rows[:1] + [r for r in rows[1:] if int(r[0]) <= self.step]
        if len(kept) != len(rows):
            buffer = io.StringIO()
            csv.writer(buffer).writerows(kept)
            write_atomically(path, buffer.getvalue())

    def _log(self, loss: float, tokens: int, elapsed: float) -> None:
        if self.rank != 0:
            return
        path = Path(self.out) / LOSS_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.is_file()
        with path.open("a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "loss", "tokens", "lr", "session_elapsed_s"])
            writer.writerow([self.step, f"{loss:.5f}", tokens, f"{self.scheduler.get_last_lr()[0]:.3e}", f"{elapsed:.1f}"])
