"""The capture passes' internal failure: the model raised, with the module it raised in."""

from __future__ import annotations


class RunFailure(Exception):
    """The model raised ``error`` in a pass, in module ``where`` (its ``named_modules()`` name, or None)."""

    def __init__(self, error: BaseException, where: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.where = where
