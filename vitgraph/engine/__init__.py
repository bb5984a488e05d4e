"""Bucketing, planning and CUDA-graph capture/replay. Model-agnostic."""

from .graphs import GraphBank
from .planner import Bucket, Plan, Step, budget_ladder, fit_budgets, make_buckets, plan_call

__all__ = ["Bucket", "GraphBank", "Plan", "Step", "budget_ladder", "fit_budgets", "make_buckets", "plan_call"]
