"""Data parallelism: flat bucketed param/grad buffers and an overlapped gradient-sync wrapper; parameter
servers (sharded parameters and AdamW on server ranks, workers that push gradients and pull parameters)."""
from ..parameter_server import (  # their own package; kept importable from here
    ParameterServerShard,
    ParameterServerWorker,
    PSLayout,
    predicted_bytes_per_step,
    ps_layout,
    serve,
)
from .buffers import Bucket, ParamAndGradBuffer
from .ddp import DataParallel, overlap_report
from .fused_grads import embedding_grad_into_buffer, grad_sink, linear_weight_grad_into_buffer
from .single_process import SingleProcessDataParallel
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm, sync_batch_norm

__all__ = ["Bucket", "ParamAndGradBuffer", "DataParallel", "overlap_report", "grad_sink",
           "linear_weight_grad_into_buffer", "embedding_grad_into_buffer", "PSLayout", "ps_layout",
           "ParameterServerWorker", "ParameterServerShard", "serve", "predicted_bytes_per_step",
           "SyncBatchNorm", "convert_sync_batchnorm", "sync_batch_norm", "SingleProcessDataParallel"]
