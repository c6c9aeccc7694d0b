"""The errors of the replicated turn log apart from the JetStream client (`jetstream.py`): a lost
compare-and-set, and a log that did not answer; so that the engine core can tell them from other
failures without importing NATS."""


class Fenced(Exception):
    """A compare-and-set lost: another engine wrote the log or the key first."""


class LogUnavailable(Exception):
    """The log did not answer a write after every try (its stream had no leader, a server was
    away): nothing was committed that a retry of the same write would not find."""
