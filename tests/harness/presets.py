"""The paper-like deployments of :data:`wb.layouts.DEPLOYMENTS`, each built once per test run:
test modules read them (layouts, spec, description) and never change them, and a large one
takes seconds to build (Kimi-K2's 512 GPUs)."""

from __future__ import annotations

import functools

from wb.layouts import deployment
from wb.layouts.deployments import Deployment

__all__ = ["real_deployment"]


@functools.cache
def real_deployment(name: str) -> Deployment:
    """``wb.layouts.deployment(name)``, built at the first call and the same object after."""
    return deployment(name)
