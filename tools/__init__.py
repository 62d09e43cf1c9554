"""Tools that work on the broker's files from outside the broker (see docs/audit.md)."""
