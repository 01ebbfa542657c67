"""Training that survives failures: asynchronous checkpoints, automatic resume, restarts under torchrun.

* :class:`AsyncCheckpointer` (:mod:`.async_save`): training waits only for the snapshot to host memory; a
  background thread writes it (checksummed, published atomically, the last K kept), universal or
  per-rank format (:mod:`.per_rank`).
* :class:`GlobalBatches` (:mod:`.data_position`): a global position in the data, which any dp size
  continues exactly.
* :func:`resume` (:mod:`.resume`): the newest complete checkpoint of a run directory (:mod:`.run_dir`),
  loaded on the same or another mesh; on the same layout every rank's random streams come back
  (:mod:`.resume_state`), so a restarted run ends bit for bit where an uninterrupted one does.
* Under ``torchrun --max-restarts N`` (or ``--nnodes MIN:MAX`` with the c10d rendezvous) a worker that
  dies takes the others down, torchrun starts them again, and a training script that calls
  :func:`resume` on start continues from the newest checkpoint: see ``python -m parallel_layers demo
  --save DIR`` and the README's "Surviving failures".
"""
from .async_save import AsyncCheckpointer, SaveRecord
from .data_position import GlobalBatches
from .resume import load_checkpoint, resume
from .run_dir import complete_checkpoints, prune

__all__ = ["AsyncCheckpointer", "SaveRecord", "GlobalBatches", "resume", "load_checkpoint", "complete_checkpoints",
           "prune"]
