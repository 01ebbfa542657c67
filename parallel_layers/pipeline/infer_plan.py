"""The tensor-parallel plan read off a model: moved to :mod:`parallel_layers.families.infer_plan`; the names
stay importable from here."""
from ..families.infer_plan import COLWISE, FUSED, ROWWISE, PlanError, infer_tp_plan

__all__ = ["infer_tp_plan", "PlanError", "COLWISE", "ROWWISE", "FUSED"]
