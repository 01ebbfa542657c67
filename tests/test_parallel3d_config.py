"""Parallel3D's settings in groups (parallel_layers.composition.config): every group rejects bad values with an
error naming Parallel3D, the field and the value; the flat keywords they replace still work for one release,
warn once naming the new form, and train the same model bit for bit; an old keyword given with its group's
config is an error; the defaults are the flat keywords' defaults."""
import inspect
import math
import warnings

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
from parallel_layers.composition.config import ZERO_ONLY_FIELDS, check_together, split_keywords
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.testing import cached_mesh
from parallel_layers.zero import ZeroOptimizer, ZeroStage3Optimizer

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)
BATCH, SEQ, STEPS = 8, 8, 3

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
    from parallel_layers.models.checkpoint_policy import MemoryBudget
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
    settings, message, rest = split_keywords({})
    assert message is None and rest == {}
    got = {f: getattr(getattr(settings, group), f) for group in ("optimizer", "pipeline", "data_parallel",
                                                                  "precision")
           for f in type(getattr(settings, group)).__dataclass_fields__}
    assert {k: got[k] for k in old} == old
    # optimizer_options=None left the ZeRO optimizers' own defaults
    for cls in (ZeroOptimizer, ZeroStage3Optimizer):
        params = inspect.signature(cls.__init__).parameters
        assert {f: params[f].default for f in ZERO_ONLY_FIELDS} == {f: got[f] for f in ZERO_ONLY_FIELDS}, cls


def test_old_keywords_warn_once_naming_each_and_the_new_form():
    with pytest.warns(DeprecationWarning) as record, pytest.raises(TypeError, match="model must be a GPTConfig"):
        Parallel3D("not a model", None, lr=1e-4, zero=1, num_microbatches=2, dtype=torch.bfloat16,
                   optimizer_options={"offload_io": "buffered"})
    assert len(record) == 1, [str(r.message) for r in record]
    assert record[0].filename == __file__          # stacklevel: the caller's line
    assert str(record[0].message) == (
        "Parallel3D: lr=, zero=, num_microbatches=, dtype=, optimizer_options= are deprecated (accepted until the "
        "next release); pass optimizer=OptimizerConfig(lr=..., offload_io=...), "
        "pipeline=PipelineConfig(num_microbatches=...), data_parallel=DataParallelConfig(zero=...), "
        "precision=PrecisionConfig(dtype=...)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the new form does not warn
        with pytest.raises(TypeError, match="model must be a GPTConfig"):
            Parallel3D("not a model", None, optimizer=OptimizerConfig(lr=1e-4), pipeline=PipelineConfig(),
                       data_parallel=DataParallelConfig(zero=1), precision=PrecisionConfig(dtype=torch.bfloat16))


def test_old_keyword_with_its_config_and_misspelt_keywords_raise():
    cfg = GPTConfig(**CFG)
    with pytest.raises(TypeError, match=r"lr= and optimizer= were both given; set it inside "
                                        r"optimizer=OptimizerConfig\(\.\.\.\) and drop lr="):
        Parallel3D(cfg, None, lr=1e-3, optimizer=OptimizerConfig())
    with pytest.raises(TypeError, match="zero= and data_parallel= were both given"):
        Parallel3D(cfg, None, zero=1, data_parallel=DataParallelConfig(zero=1))
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['learning_rate'\]"):
        Parallel3D(cfg, None, learning_rate=1e-3)
    with pytest.raises(TypeError, match=r"optimizer_options has unknown key\(s\) \['offlaod'\]"):
        Parallel3D(cfg, None, zero=1, optimizer_options={"offlaod": "disk"})
    with pytest.raises(TypeError, match=r"optimizer_options has unknown key\(s\) \['lr'\]"):
        Parallel3D(cfg, None, zero=1, optimizer_options={"lr": 1e-3})
    with pytest.raises(TypeError, match="optimizer= takes a OptimizerConfig, not SGD"):
        Parallel3D(cfg, None, optimizer=torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    # the checks of a group run on the old keywords too, before anything is built
    with pytest.raises(ValueError, match="^Parallel3D: zero=4 must be 0"):
        Parallel3D(cfg, None, zero=4)


def _batches():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG["vocab_size"], (STEPS, BATCH, SEQ + 1), generator=gen)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]


def _train(build):
    """Build a model (recording the warnings its constructor gives), train it STEPS steps: (losses, grad
    norms, deprecation warnings, dense parameters)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = build()
    outs = [model.train_step(x, y) for x, y in _batches()]
    state = model.dense_state_dict()
    if model.settings.optimizer.offload is not None:
        model.optimizer.close_offload()
    return ([o["loss"] for o in outs], [o["grad_norm"] for o in outs],
            [str(r.message) for r in record if issubclass(r.category, DeprecationWarning)], state)


def body_old_and_new_forms_train_identically(rank, world, directory):
    cfg = GPTConfig(**CFG, dropout=0.1)
    dp2, pp2 = cached_mesh(dp=2), cached_mesh(pp=2)
    no_decay = lambda n, p: p.ndim < 2  # noqa: E731
    cases = {
        # clipping, no_decay, small buckets, gpipe, checkpointing with dropout, the non-finite skip
        "zero0": (lambda: Parallel3D(cfg, dp2, zero=0, schedule="gpipe", num_microbatches=2, lr=3e-3,
                                     betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, no_decay=no_decay,
                                     max_grad_norm=0.5, bucket_cap_mb=0.002, checkpoint=True,
                                     skip_nonfinite=True, seed=3),
                  lambda: Parallel3D(cfg, dp2, optimizer=OptimizerConfig(lr=3e-3, betas=(0.8, 0.9), eps=1e-6,
                                                                          weight_decay=0.1, no_decay=no_decay,
                                                                          max_grad_norm=0.5),
                                     pipeline=PipelineConfig(schedule="gpipe", num_microbatches=2, checkpoint=True),
                                     data_parallel=DataParallelConfig(zero=0, bucket_cap_mb=0.002),
                                     precision=PrecisionConfig(skip_nonfinite=True), seed=3)),
        # fp16 with its own loss scaler under ZeRO-1
        "zero1-fp16": (lambda: Parallel3D(cfg, dp2, zero=1, num_microbatches=2, lr=1e-3, dtype=torch.float16,
                                          loss_scaler=DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=1)),
                       lambda: Parallel3D(cfg, dp2, optimizer=OptimizerConfig(lr=1e-3),
                                          pipeline=PipelineConfig(num_microbatches=2),
                                          data_parallel=DataParallelConfig(zero=1),
                                          precision=PrecisionConfig(dtype=torch.float16, loss_scaler=DynamicLossScaler(
                                              init_scale=2.0 ** 12, growth_interval=1)))),
        # ZeRO-3 with its state on disk: optimizer_options -> OptimizerConfig's offload fields
        "zero3-offload": (lambda: Parallel3D(cfg, dp2, zero=3, num_microbatches=2, weight_decay=0.1,
                                             optimizer_options={"offload": "disk", "offload_dir": directory}),
                          lambda: Parallel3D(cfg, dp2, optimizer=OptimizerConfig(weight_decay=0.1, offload="disk",
                                                                                  offload_dir=directory),
                                             pipeline=PipelineConfig(num_microbatches=2),
                                             data_parallel=DataParallelConfig(zero=3))),
        # the pipeline's settings: two stages, interleaved chunks, the first block of each chunk recomputed
        "pp2-interleaved": (lambda: Parallel3D(cfg, pp2, schedule="interleaved", num_chunks=2, num_microbatches=4,
                                               checkpoint=1),
                            lambda: Parallel3D(cfg, pp2, pipeline=PipelineConfig(schedule="interleaved", num_chunks=2,
                                                                                 num_microbatches=4, checkpoint=1))),
    }
    out = {}
    for name, (old, new) in cases.items():
        o, n = _train(old), _train(new)
        out[name] = {"old warnings": o[2], "new warnings": n[2], "losses": (o[0], n[0]), "norms": (o[1], n[1]),
                     "same weights": o[3].keys() == n[3].keys() and all(torch.equal(o[3][k], n[3][k]) for k in o[3])}
    return out


def test_old_and_new_forms_train_bit_identically(dist_pools, tmp_path):
    for rank, res in enumerate(dist_pools(2).run(body_old_and_new_forms_train_identically, str(tmp_path),
                                                 timeout=240)):
        for name, r in res.items():
            assert len(r["old warnings"]) == 1 and "deprecated" in r["old warnings"][0], (rank, name, r)
            assert r["new warnings"] == [], (rank, name, r)
            old, new = r["losses"]
            assert len(old) == STEPS and all(math.isfinite(v) for v in old), (rank, name, old)
            assert old == new, (rank, name, r["losses"])
            assert r["norms"][0] == r["norms"][1], (rank, name, r["norms"])
            assert r["same weights"], (rank, name)
