"""Error types. Every message names the offending field and its value."""


class DFlashError(Exception):
    """Base class for errors raised by tensorrt_llm_dflash."""


class DFlashInputError(DFlashError, ValueError):
    """Bad user input: a budget, a prompt, a generation setting."""


class DFlashConfigError(DFlashError, ValueError):
    """A drafter or target that cannot work together, or a malformed checkpoint."""
