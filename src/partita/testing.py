"""Test harness: small local worlds for the tests."""

from __future__ import annotations

from partita.local_world import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
