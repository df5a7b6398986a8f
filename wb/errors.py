"""One hierarchy of errors a person can act on."""

from __future__ import annotations

__all__ = ["WbError", "SpecError", "ProbeError", "PlanError", "TransferError"]


class WbError(Exception):
    """Base class of every error raised by WeightBridge."""


class SpecError(WbError, ValueError):
    """A checkpoint spec, source map or layout argument is malformed."""


class ProbeError(WbError):
    """A load function is not pure data movement, raised, or returned something unusable."""


class PlanError(WbError):
    """Layouts cannot be served (an id needed and held by nobody) or a plan is inconsistent."""


class TransferError(WbError):
    """A transfer failed: a peer died or hung, or the buffers do not match the plan."""
