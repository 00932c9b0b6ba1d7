"""Trainers for drafters (one module per method), checkpoints in safetensors, resumable."""
