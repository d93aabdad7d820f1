"""Reconfiguration planning: PTC x PTC (x lost devices) -> the exact pieces every new rank pulls, from where."""

from .central import central_plan
from .plan import Fetch, Plan, PlanError, Route, plan
from .stats import Bandwidth, PlanStats

__all__ = ["Bandwidth", "Fetch", "Plan", "PlanError", "PlanStats", "Route", "central_plan", "plan"]
