"""The parameter-server worker: moved to :mod:`parallel_layers.parameter_server.worker`; the name stays
importable from here."""
from ..parameter_server.worker import ParameterServerWorker

__all__ = ["ParameterServerWorker"]
