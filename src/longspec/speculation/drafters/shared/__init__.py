"""Pieces several drafters use: n-gram tables and chain trees, partial KV caches,
vocabulary maps, bandit and tree-size policies, argument checks and the mismatch
error. A drafter's own package never imports another drafter's package; what two
of them share lives here."""
