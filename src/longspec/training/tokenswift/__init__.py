"""Training TokenSwift's multi-token heads (`speculation/drafters/tokenswift`): their data,
the trainer over fresh target forwards, and the one over cached features."""
