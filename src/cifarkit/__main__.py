from cifarkit.cli import entry

raise SystemExit(entry())
