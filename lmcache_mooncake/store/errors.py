"""The error of the store's launcher and client (its own module so both can import it)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store cannot be started, inspected, stopped or reached; the message says why and what to do."""
