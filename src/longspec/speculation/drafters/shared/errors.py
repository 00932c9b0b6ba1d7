"""Errors drafters share."""


class DraftMismatchError(ValueError):
    """A draft checkpoint does not fit the target it is paired with."""
