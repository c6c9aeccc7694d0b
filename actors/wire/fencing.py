"""The error of a lost compare-and-set on the replicated turn log or an owner key, apart from
the JetStream client (`jetstream.py`), so that the engine core can tell it from other failures
without importing NATS."""


class Fenced(Exception):
    """A compare-and-set lost: another engine wrote the log or the key first."""
