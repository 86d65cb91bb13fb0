"""Launch modes, one module each: ``local`` (elastic agent on this host) and ``torchrun`` (already a worker)."""

from .plan import LaunchPlan, plan_job

__all__ = ["LaunchPlan", "plan_job"]
