"""A drafter's reduced vocabulary: the target tokens it can read and propose.

A small external drafter for a target with a large vocabulary (Gemma: 262k tokens)
would spend most of each step in its embedding and output layer. It speaks a reduced
vocabulary instead: draft id i < N is target token `target_ids[i]` (the N most
frequent tokens of the training corpus, EOS always among them), and draft id N is
"any other token", what every other target token reads as. The drafter never
proposes that id; verification stays exact over the target's full vocabulary.

Saved beside the drafter's weights as `longspec-vocab.json`; training and inference
build their lookups from the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from longspec.runtime.device import HOST

FILE_NAME = "longspec-vocab.json"
FORMAT = "longspec-vocab-map/1"


class VocabMap:
    def __init__(self, target_ids: torch.Tensor | list[int], target_vocab_size: int) -> None:
        ids = torch.as_tensor(target_ids, dtype=torch.long, device=HOST).reshape(-1)
        if ids.numel() < 1:
            raise ValueError("a reduced vocabulary needs at least one target token")
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size:
            raise ValueError(f"reduced-vocabulary ids must lie in [0, {target_vocab_size}) (the target's vocabulary)")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("reduced-vocabulary ids repeat a target token")
        self.target_ids = ids
        self.target_vocab_size = int(target_vocab_size)
        self.other = ids.numel()  # the draft id of every target token outside the map
        self._to_draft = torch.full((target_vocab_size,), self.other, dtype=torch.long, device=HOST)
        self._to_draft[ids] = torch.arange(ids.numel(), device=HOST)

    @property
    def draft_vocab_size(self) -> int:
        """Draft ids: the mapped tokens and the "other" id."""
        return self.other + 1

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        return self._lookup(self._to_draft, target_ids)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of proposed draft ids (never the "other" id)."""
        return self._lookup(self.target_ids, draft_ids)

    def hide_other(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., N + 1] with the "other" id removed from the candidates."""
        return logits[..., : self.other]

    def to(self, device: torch.device) -> "VocabMap":
        """The lookups on `device` (where the drafter computes): ids come out there."""
        moved = object.__new__(VocabMap)
        moved.__dict__.update(self.__dict__)
        moved.target_ids, moved._to_draft = self.target_ids.to(device), self._to_draft.to(device)
        return moved

    # ------------------------------------------------------------------ files
    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FILE_NAME
        path.write_text(json.dumps({"format": FORMAT, "target_vocab_size": self.target_vocab_size,
                                    "target_ids": self.target_ids.tolist()}))
        return path

    @staticmethod
    def load(directory: str | Path) -> "VocabMap | None":
        """The map saved in a drafter's directory; None when it speaks the full vocabulary."""
        path = Path(directory) / FILE_NAME
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a longspec vocabulary map (format {data.get('format')!r})")
        return VocabMap(data["target_ids"], data["target_vocab_size"])

    def check_fits(self, drafter: str, model_ids: int, target_config) -> None:
        """Raise DraftMismatchError naming what does not fit: a map over another target
        vocabulary, EOS ids it cannot propose, or a model with fewer ids than the map."""
        from longspec.speculation.drafters.shared.errors import DraftMismatchError

        problems = []
        if target_config.vocab_size != self.target_vocab_size:
            problems.append(f"vocabulary: the drafter's map is over {self.target_vocab_size} target ids, "
                            f"the target has {target_config.vocab_size}")
        missing = sorted(set(target_config.eos_token_ids) - set(self.target_ids.tolist()))
        if missing:
            problems.append(f"end-of-sequence ids {missing} are outside the drafter's reduced vocabulary")
        if model_ids < self.draft_vocab_size:
            problems.append(f"the model has {model_ids} ids, its vocabulary map needs {self.draft_vocab_size}")
        if problems:
            raise DraftMismatchError(f"the {drafter}'s reduced vocabulary does not fit the target (" + "; ".join(problems)
                                     + "); use a drafter trained for this target")

    @staticmethod
    def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return table[ids.to(table.device)]  # on the map's device (see `to`)
