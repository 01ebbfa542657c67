"""Parameter servers' layout, wire protocol and traffic model: moved to
:mod:`parallel_layers.parameter_server.protocol` (the parameter servers are their own package); the names
stay importable from here."""
from ..parameter_server.protocol import (  # noqa: F401
    ABORT,
    ALIGN,
    HEADER_LEN,
    LEAVE,
    OK,
    PLAN,
    PULL,
    PUSH,
    BucketPlan,
    PSLayout,
    Traffic,
    check_header,
    header,
    header_buffer,
    irecv,
    isend,
    plan_buckets,
    predicted_bytes_per_step,
    ps_layout,
)

__all__ = ["PSLayout", "ps_layout", "BucketPlan", "plan_buckets", "Traffic", "predicted_bytes_per_step"]
