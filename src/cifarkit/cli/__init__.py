"""The `cifarkit` command line: `main` parses and runs a command; one module per command group."""
from cifarkit.cli.main import build_parser, entry, main, options

__all__ = ["build_parser", "entry", "main", "options"]
