"""The one error type the CLI turns into a single clear line."""


class OmniDraftError(Exception):
    """A user-facing error: its message names the bad value and the fix, on one line."""
