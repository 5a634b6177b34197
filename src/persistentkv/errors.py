"""User-facing errors.

Every check on user input raises :class:`PKVError` with a one-line message that names the
offending value. The CLI prints it as ``error: <message>`` and exits with status 2, so a user
never sees a traceback from deep inside the library for a mistake in their own input.
"""

from __future__ import annotations


class PKVError(ValueError):
    """Bad input, a missing dependency for the requested work, or an unsupported combination."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`PKVError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise PKVError(message)
