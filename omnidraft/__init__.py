"""OmniDraft lab: online-adaptive, cross-vocabulary speculative decoding."""

from omnidraft.errors import OmniDraftError

__all__ = ["OmniDraftError"]
__version__ = "0.1.0"
