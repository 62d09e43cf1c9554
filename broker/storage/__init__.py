"""Where records go: the journal interface and its implementations."""

from broker.storage.journal import CommitWaiter, Journal, JournalEntry
from broker.storage.memory import InMemoryJournal

__all__ = ["CommitWaiter", "InMemoryJournal", "Journal", "JournalEntry"]
