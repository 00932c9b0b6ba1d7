"""Medusa-style self-drafting on the verification pass (TokenSwift's "Medusa*"
ablation): the same one-forward-per-round drafter as `tokenswift-onepass`, with heads
that each read the target's last hidden state alone (h_i = h_0 + f_i(h_0)) instead of
TokenSwift's residual chain. Train such heads with `longspec train tokenswift
--independent-heads`; none are shipped."""

from __future__ import annotations

from pathlib import Path

from longspec.speculation.drafters.tokenswift.heads import TokenSwiftHeads
from longspec.speculation.drafters.tokenswift.one_pass import OnePassTokenSwiftDrafter


class MedusaDrafter(OnePassTokenSwiftDrafter):
    """Options as `tokenswift-onepass`; `heads` (independent heads, a file or object) is required."""

    def __init__(self, heads: TokenSwiftHeads | str | Path | None = None, *, widths: tuple[int, ...] = (2, 1, 1),
                 k: int = 2, ngram: int = 4, context_vocab: bool = True) -> None:
        if heads is None:
            raise ValueError("medusa needs independent heads (none are shipped): train them with `longspec train "
                             "tokenswift --independent-heads` and pass heads=PATH")
        super().__init__(heads, widths=widths, k=k, ngram=ngram, context_vocab=context_vocab)

    def check_target(self, config) -> None:
        super().check_target(config)
        if self.heads.config.chained:
            raise ValueError("these are TokenSwift's chained heads: use method tokenswift-onepass, or train "
                             "independent ones with `longspec train tokenswift --independent-heads`")
