class CifarkitError(Exception):
    """A user-facing problem: the message names what is wrong and how to fix it, on one line."""
