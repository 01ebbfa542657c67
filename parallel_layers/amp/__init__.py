"""Mixed precision: a precision policy, a device-side dynamic loss scaler, and global gradient clipping
that is correct across data, tensor and pipeline parallel ranks."""
from .clip import clip_grad_norm_, fused_optimizer_grad_scale, grad_multiplier
from .policy import PrecisionPolicy
from .scaler import DynamicLossScaler

__all__ = ["PrecisionPolicy", "DynamicLossScaler", "clip_grad_norm_", "grad_multiplier",
           "fused_optimizer_grad_scale"]
