"""Parallel3D's settings in groups (parallel_layers.composition.config): every group rejects bad values with an
error naming Parallel3D, the field and the value; a flat keyword the groups replaced (``lr=``, ``zero=``, ...) is a
TypeError naming the group and field to use; the defaults are those the flat keywords had."""
import inspect
import math

import pytest
import torch

from parallel_layers import (
    DataParallelConfig,
    DynamicLossScaler,
    OptimizerConfig,
    Parallel3D,
    PipelineConfig,
    PrecisionConfig,
)
from parallel_layers.composition.config import MOVED_KEYWORDS, ZERO_ONLY_FIELDS, check_together, split_keywords
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.zero import ZeroOptimizer, ZeroStage3Optimizer

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)

BAD = [
    (OptimizerConfig, dict(lr=-1e-3), "lr=-0.001"),
    (OptimizerConfig, dict(lr=math.nan), "lr=nan"),
    (OptimizerConfig, dict(eps=-1.0), "eps=-1.0"),
    (OptimizerConfig, dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (OptimizerConfig, dict(betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\).*\[0, 1\)"),
    (OptimizerConfig, dict(betas=(0.9,)), r"betas=\(0.9,\)"),
    (OptimizerConfig, dict(no_decay="biases"), "no_decay='biases'.*lambda n, p"),
    (OptimizerConfig, dict(max_grad_norm=0.0), "max_grad_norm=0.0.*max_grad_norm=None"),
    (OptimizerConfig, dict(backend=3), "backend=3"),
    (OptimizerConfig, dict(offload="gpu"), "offload='gpu'.*'disk'"),
    (OptimizerConfig, dict(offload="disk"), "offload='disk'.*offload_dir=DIR"),
    (OptimizerConfig, dict(offload_dir="/tmp/x"), "offload_dir='/tmp/x'.*offload='disk'"),
    (OptimizerConfig, dict(offload="disk", offload_dir="/tmp/x", offload_buffer_mb=0), "offload_buffer_mb=0"),
    (OptimizerConfig, dict(offload="disk", offload_dir="/tmp/x", offload_io="async"), "offload_io='async'"),
    (OptimizerConfig, dict(offload="disk", offload_dir="/tmp/x", offload_delayed_update=True),
     "offload_delayed_update=True.*offload='cpu'"),
    (PipelineConfig, dict(schedule="pipedream"), "schedule='pipedream'.*1f1b"),
    (PipelineConfig, dict(num_microbatches=0), "num_microbatches=0.*>= 1"),
    (PipelineConfig, dict(num_microbatches=2.0), "num_microbatches=2.0"),
    (PipelineConfig, dict(num_chunks=0), "num_chunks=0.*None picks 2"),
    (PipelineConfig, dict(boundaries="blocks"), "boundaries='blocks'.*'parameters'"),
    (PipelineConfig, dict(boundaries=[2, -1]), r"boundaries=\[2, -1\]"),
    (PipelineConfig, dict(block_costs=[1.0, math.inf]), r"block_costs=\[1.0, inf\]"),
    (PipelineConfig, dict(checkpoint="all"), "checkpoint='all'.*'sqrt'"),
    (PipelineConfig, dict(checkpoint=True, checkpoint_inputs="disk"), "checkpoint_inputs='disk'.*partition"),
    (DataParallelConfig, dict(zero=4), "zero=4 must be 0 .*1, 2 or 3"),
    (DataParallelConfig, dict(zero=True), "zero=True must be 0"),
    (DataParallelConfig, dict(bucket_cap_mb=0), "bucket_cap_mb=0.*> 0"),
    (PrecisionConfig, dict(dtype=torch.int64), "dtype=torch.int64.*floating"),
    (PrecisionConfig, dict(autocast=torch.float16), "autocast=torch.float16 is not supported.*bfloat16"),
    (PrecisionConfig, dict(loss_scaler=2.0 ** 16), "loss_scaler=float.*DynamicLossScaler"),
    (PrecisionConfig, dict(skip_nonfinite=1), "skip_nonfinite=1"),
    (PrecisionConfig, dict(dtype=torch.bfloat16, autocast=torch.bfloat16), "autocast is for fp32 weights"),
    (PrecisionConfig, dict(dtype=torch.float32, loss_scaler=DynamicLossScaler()), "loss_scaler is for fp16"),
    (PrecisionConfig, dict(dtype=torch.float16, skip_nonfinite=True), "skip_nonfinite is for fp32/bf16"),
]


@pytest.mark.parametrize("cls,kwargs,match", BAD, ids=[f"{c.__name__}-{m.split('=')[0]}" for c, _, m in BAD])
def test_every_config_rejects_bad_values_naming_parallel3d_and_the_field(cls, kwargs, match):
    with pytest.raises(ValueError, match=f"^Parallel3D: .*{match}"):
        cls(**kwargs)


def test_configs_accept_every_documented_form():
    from parallel_layers.activations.checkpoint_policy import MemoryBudget
    OptimizerConfig(lr=0.0, betas=[0.0, 0.999], eps=0, weight_decay=0.1, no_decay=lambda n, p: p.ndim < 2,
                    max_grad_norm=None, offload="disk", offload_dir="/tmp/x", offload_io="direct")
    OptimizerConfig(offload="cpu", offload_delayed_update=True, backend="torch", max_grad_norm=math.inf)
    for checkpoint in (True, False, 0, 3, "sqrt", MemoryBudget(1e6)):
        PipelineConfig(checkpoint=checkpoint)
    PipelineConfig(schedule="zbv", num_chunks=2, boundaries=[2, 4], block_costs=(1, 2.5), checkpoint=True,
                   checkpoint_inputs="partition+offload")
    PipelineConfig(boundaries="parameters")
    for zero in (0, 1, 2, 3):
        DataParallelConfig(zero=zero, bucket_cap_mb=0.002)
    PrecisionConfig(dtype=torch.float16, loss_scaler=DynamicLossScaler())
    PrecisionConfig(dtype=torch.float32, autocast=torch.bfloat16, skip_nonfinite=True)


def test_checks_across_groups_name_both_settings():
    fp32, bf16 = PrecisionConfig(dtype=torch.float32), PrecisionConfig(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"zero=3 supports fp32, bf16 and fp16 models \(dtype=torch.float64\)"):
        check_together(OptimizerConfig(), DataParallelConfig(zero=3), PrecisionConfig(dtype=torch.float64))
    with pytest.raises(ValueError, match="needs fp32 master weights; use zero=1, 2 or 3"):
        check_together(OptimizerConfig(), DataParallelConfig(zero=0), bf16)
    with pytest.raises(ValueError, match=r"OptimizerConfig\(offload='disk', offload_dir='/d'\) applies to the ZeRO"):
        check_together(OptimizerConfig(offload="disk", offload_dir="/d"), DataParallelConfig(zero=0), fp32)
    check_together(OptimizerConfig(offload="disk", offload_dir="/d"), DataParallelConfig(zero=3), fp32)
    check_together(OptimizerConfig(), DataParallelConfig(zero=1), bf16)
    for low in (bf16, PrecisionConfig(dtype=torch.float16)):    # ZeRO-3 keeps fp32 master weights too
        check_together(OptimizerConfig(), DataParallelConfig(zero=3), low)


def test_defaults_are_the_flat_keywords_defaults():
    # Parallel3D's flat keywords and their defaults before the groups
    old = dict(zero=0, schedule="1f1b", num_microbatches=4, num_chunks=None, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
               weight_decay=0.0, no_decay=None, max_grad_norm=1.0, dtype=None, bucket_cap_mb=25.0, loss_scaler=None,
               checkpoint=False, skip_nonfinite=False, boundaries=None, block_costs=None, autocast=None,
               checkpoint_inputs=None)
    settings, rest = split_keywords({})
    assert rest == {}
    got = {f: getattr(getattr(settings, group), f) for group in ("optimizer", "pipeline", "data_parallel",
                                                                  "precision")
           for f in type(getattr(settings, group)).__dataclass_fields__}
    assert {k: got[k] for k in old} == old
    # OptimizerConfig's ZeRO-only fields: the ZeRO optimizers' own defaults
    for cls in (ZeroOptimizer, ZeroStage3Optimizer):
        params = inspect.signature(cls.__init__).parameters
        assert {f: params[f].default for f in ZERO_ONLY_FIELDS} == {f: got[f] for f in ZERO_ONLY_FIELDS}, cls


def test_flat_keywords_are_a_type_error_naming_their_group_and_field():
    cfg = GPTConfig(**CFG)
    with pytest.raises(TypeError) as err:
        Parallel3D(cfg, None, lr=1e-4, zero=1, num_microbatches=2, dtype=torch.bfloat16,
                   optimizer_options={"offload_io": "buffered"})
    assert str(err.value) == (
        "Parallel3D: lr=, zero=, num_microbatches=, dtype=, optimizer_options= moved into the config groups; pass "
        "optimizer=OptimizerConfig(lr=..., offload=..., ...), pipeline=PipelineConfig(num_microbatches=...), "
        "data_parallel=DataParallelConfig(zero=...), precision=PrecisionConfig(dtype=...)")
    # every old keyword, alone or next to its group's config, names its group; the group has a field of that name
    classes = {"optimizer": OptimizerConfig, "pipeline": PipelineConfig, "data_parallel": DataParallelConfig,
               "precision": PrecisionConfig}
    for name, group in MOVED_KEYWORDS.items():
        cls = classes[group]
        assert name == "optimizer_options" or name in cls.__dataclass_fields__, name
        for extra in ({}, {group: cls()}):
            with pytest.raises(TypeError, match=rf"^Parallel3D: {name}= moved into the config groups; pass "
                                                rf"{group}={cls.__name__}\("):
                Parallel3D(cfg, None, **{name: 1}, **extra)


def test_misspelt_keywords_and_wrong_config_types_raise():
    cfg = GPTConfig(**CFG)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['learning_rate'\]"):
        Parallel3D(cfg, None, learning_rate=1e-3)
    with pytest.raises(TypeError, match="optimizer= takes a OptimizerConfig, not SGD"):
        Parallel3D(cfg, None, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    with pytest.raises(TypeError, match="data_parallel= takes a DataParallelConfig, not dict"):
        Parallel3D(cfg, None, data_parallel={"zero": 1})


def test_freeze_trainer_names_the_group_too():
    from parallel_layers.freeze_training.trainer import FreezeTrainer
    with pytest.raises(TypeError, match=r"^FreezeTrainer: zero= moved into the config groups; pass "
                                        r"data_parallel=DataParallelConfig\(zero=\.\.\.\)"):
        FreezeTrainer(lambda: None, dp=1, pp=1, loss_fn=None, zero=1)
