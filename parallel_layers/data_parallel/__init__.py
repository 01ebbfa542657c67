"""Data parallelism: flat bucketed param/grad buffers and an overlapped gradient-sync wrapper (parameter
servers are their own package, :mod:`parallel_layers.parameter_server`)."""
from .buffers import Bucket, ParamAndGradBuffer
from .ddp import DataParallel, overlap_report
from .fused_grads import embedding_grad_into_buffer, grad_sink, linear_weight_grad_into_buffer
from .single_process import SingleProcessDataParallel
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm

__all__ = ["Bucket", "ParamAndGradBuffer", "DataParallel", "overlap_report", "grad_sink",
           "linear_weight_grad_into_buffer", "embedding_grad_into_buffer", "SyncBatchNorm", "convert_sync_batchnorm",
           "sync_batch_norm", "SingleProcessDataParallel"]
