"""Data parallelism: flat bucketed param/grad buffers and an overlapped gradient-sync wrapper."""
from .buffers import Bucket, ParamAndGradBuffer
from .ddp import DataParallel, overlap_report
from .fused_grads import embedding_grad_into_buffer, grad_sink, linear_weight_grad_into_buffer

__all__ = ["Bucket", "ParamAndGradBuffer", "DataParallel", "overlap_report", "grad_sink",
           "linear_weight_grad_into_buffer", "embedding_grad_into_buffer"]
