"""The parameter server's side: moved to :mod:`parallel_layers.parameter_server.server`; the names stay
importable from here."""
from ..parameter_server.server import ParameterServerShard, serve

__all__ = ["ParameterServerShard", "serve"]
