"""Freeze training with elastic pipelining, after PipeTransformer (He, Li, Soltanolkotabi, Avestimehr:
"PipeTransformer: Automated Elastic Pipelining for Distributed Training of Transformers", ICML 2021).

One training run, no process restarted, freezes the bottom blocks of a model once they stop changing
and gives the ranks they free to data parallelism::

    trainer = FreezeTrainer(lambda: (torch.manual_seed(0), GPT(cfg))[1], dp=1, pp=4, loss_fn=gpt_loss,
                            freeze="auto", freeze_cap=0.5, zero=1, num_microbatches=4, lr=1e-3)
    for step, (x, y, ids) in enumerate(batches):       # ids: the samples' indices, for the prefix cache
        out = trainer.train_step(x, y, sample_ids=ids)  # out["relayout"]: the layout change, if any

All four parts of the paper are here, built on ``Parallel3D`` (pipeline, data parallel, ZeRO 0-3) and the
universal checkpoint's dense form; the model is anything ``Parallel3D`` takes through a
:class:`~parallel_layers.families.Recipe` (the reference GPT, Hugging Face Llama / GPT-2 / BERT, your own
``Recipe.sequential``):

* **AutoFreeze** (:mod:`.auto_freeze`): a fixed schedule (``"3:2,10:4"``) or the adaptive criterion: the
  bottom blocks whose windowed gradient norm stopped changing are frozen, a bounded number per decision,
  never more than a cap. *Differs*: the paper's thresholds and its schedule of how much may freeze per
  epoch are replaced by ``threshold`` / ``rate`` / ``cap`` per window of steps; the norms are summed over
  every rank by one all-reduce, so each rank takes the same decision.
* **AutoPipe** (:mod:`.relayout`): the active blocks re-partitioned over the fewest pipeline stages whose
  most expensive stage, by the blocks' *measured* forward times (x3 for backward), fits the starting
  layout's; the exact min-max partition (``balanced_boundaries``), the frozen prefix's cost on the first
  stage. *Differs*: the paper balances by parameter sizes and halves the pipeline length; here any
  divisor of the world up to the current length, and measured times.
* **AutoDP** (:mod:`.relayout`, :mod:`.trainer`): the ranks freed become replicas of the shorter pipeline,
  in the same processes: a new ``ParallelMesh`` (new process groups, made in the same order on every
  rank), and the state moved through the dense form of a universal checkpoint in memory (parameters,
  AdamW moments, step count; ZeRO shards re-cut at the new dp size). *Differs*: the paper keeps DDP
  replicas and forks new ones; here every layout is a fresh ``Parallel3D``, so ZeRO and any recipe come
  along, at the price of rebuilding the stages at each freeze (measured in ``history``).
* **AutoCache** (:mod:`.cache`): the frozen prefix's output per sample index, computed once and reused
  in later epochs, bounded in bytes, emptied when the prefix grows. *Differs*: the paper shares one
  cache through host shared memory; here each first-stage rank holds its own, filled from the whole
  global batch so that every replica's is the same.

Parity: with freezing off the trainer is ``Parallel3D`` bit for bit; with a fixed schedule it matches a
single-process run that sets ``requires_grad=False`` on the same blocks at the same steps
(:func:`freeze_prefix_`), the embedding frozen with them (a tied LM head too: one parameter). The frozen
prefix runs in eval mode (no dropout), so the single-process run must run it so as well.
Not done: tensor parallelism inside a layout (tp is 1), per-rank checkpoints of a freeze-training run,
unfreezing.
"""
from .auto_freeze import AutoFreeze, FreezePolicy, FreezeSchedule, NoFreeze, max_frozen, parse_freeze
from .cache import PrefixCache
from .layout_timeline import draw_panels
from .prefix import FrozenPrefix, freeze_prefix_, full_name, split_at
from .relayout import Layout, choose_layout, stage_costs
from .trainer import FreezeTrainer

__all__ = ["FreezeTrainer", "FreezePolicy", "NoFreeze", "FreezeSchedule", "AutoFreeze", "parse_freeze", "max_frozen",
           "PrefixCache", "FrozenPrefix", "freeze_prefix_", "split_at", "full_name", "Layout", "choose_layout",
           "stage_costs", "draw_panels"]
