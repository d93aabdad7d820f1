"""Reconfiguration planning: old PTC x new PTC (x lost devices) -> what every new rank pulls, from where."""

from .assign import assign, assign_plan
from .central import central_plan
from .plan import Fetch, Plan, PlanError, Route, SourcePolicy, plan
from .stats import Bandwidth, PlanStats

__all__ = [
    "Bandwidth",
    "Fetch",
    "Plan",
    "PlanError",
    "PlanStats",
    "Route",
    "SourcePolicy",
    "assign",
    "assign_plan",
    "central_plan",
    "plan",
]
