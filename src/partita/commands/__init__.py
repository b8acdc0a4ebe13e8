"""Subcommands of the `partita` command line, one module each."""
