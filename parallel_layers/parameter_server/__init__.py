"""Parameter-server data parallelism: server ranks hold the parameters, sharded, with their AdamW state;
worker ranks push gradients and pull parameters (:mod:`.protocol`: the layout of ranks, the buckets and the
messages both sides agree on, and the traffic model; :mod:`.worker`; :mod:`.server`). It shares nothing
with :class:`~parallel_layers.data_parallel.DataParallel`'s all-reduce but the goal."""
from .protocol import PSLayout, predicted_bytes_per_step, ps_layout
from .server import ParameterServerShard, serve
from .worker import ParameterServerWorker

__all__ = ["PSLayout", "ps_layout", "predicted_bytes_per_step", "ParameterServerShard", "serve",
           "ParameterServerWorker"]
