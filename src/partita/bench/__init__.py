"""Benchmarks run by `partita bench NAME`; each compares partita with a peer in one run."""
