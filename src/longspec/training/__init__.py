"""Trainers for drafters, checkpoints in safetensors, resumable.

One package per drafter that has its own training code, mirroring
`speculation/drafters/<name>/` (`longspec`, `tokenswift`); the external drafters
(`mamba`, `draft_model`) share `external_drafter`. Corpora, fingerprints, the
target's own responses and the resumable loop serve them all."""
