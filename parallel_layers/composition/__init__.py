"""The composition layer: :class:`Parallel3D` builds a dp x tp x pp (x cp) mesh over the layers below it;
``config`` holds its settings in four checked groups; ``replicas`` puts each data-parallel mode behind one
interface; ``universal_checkpoint`` saves and loads a run on any layout."""
from .config import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig

__all__ = ["OptimizerConfig", "PipelineConfig", "DataParallelConfig", "PrecisionConfig"]
