"""What a block's activations cost and how to cut it: activation recomputation with the dropout masks replayed
(:mod:`.recompute`), where to recompute (:mod:`.checkpoint_policy`), and how a checkpointed block keeps its
input (:mod:`.partitioned_checkpoint`: a ``1/tp`` slice per rank, :mod:`.activation_offload`: in host memory).

Used by the reference GPT (``models/``) and the pipeline's stages alike, so it sits below both.
"""
