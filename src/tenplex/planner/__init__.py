"""Reconfiguration planning: old PTC x new PTC (x lost devices) -> what every new rank pulls, from where."""

from .central import central_plan
from .plan import Fetch, Plan, PlanError, Route, plan
from .stats import Bandwidth, PlanStats

__all__ = ["Bandwidth", "Fetch", "Plan", "PlanError", "PlanStats", "Route", "central_plan", "plan"]
