"""Training the LongSpec draft (`speculation/drafters/longspec`): the target's features,
what a training query may see, the trainer, its warm start, held-out agreement."""
