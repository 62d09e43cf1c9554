"""The compatibility surfaces (docs/compat.md), each driven as its documented client drives it."""
