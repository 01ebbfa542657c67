"""Data parallelism: flat bucketed param/grad buffers and an overlapped gradient-sync wrapper."""
from .buffers import Bucket, ParamAndGradBuffer
from .ddp import DataParallel, overlap_report

__all__ = ["Bucket", "ParamAndGradBuffer", "DataParallel", "overlap_report"]
