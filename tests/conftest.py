"""Shared test set-up.

TRITON_INTERPRET must be set before parallel_layers.triton_kernels is imported (triton reads it when @triton.jit
runs), so it is set here, at collection time, before any test module imports the package: on a machine
without a GPU the Triton kernels run through the interpreter on CPU tensors; with a GPU they are
compiled and run on CUDA tensors (set TRITON_INTERPRET=1 there to test the interpreter instead).

On a GPU machine a CUDA backend that is not there (an extension built without its CUDA part, Triton
missing) fails the CUDA tests instead of skipping them: the point of running there is to run them.
"""
import gc
import os

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Parallel3D checks that every replicated parameter is bit-identical on every rank after EVERY step of the
# suite (by default only the first steps and every 100th): no model can drift silently in a test.
# Set before the worker pools start, so every worker inherits it.
os.environ.setdefault("PARALLEL_LAYERS_REPLICA_CHECK", "every")

import pytest  # noqa: E402

from parallel_layers.ops import _backend  # noqa: E402

# (device, backend) pairs that are compared against the torch reference.
KERNEL_TARGETS = [("cpu", "cpp"), ("cpu", "triton"), ("cuda", "triton"), ("cuda", "cuda")]


def target_skip_reason(device: str, backend: str):
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if device == "cpu" and backend == "triton" and not _backend.triton_interpreting():
        return "TRITON_INTERPRET is not set: Triton cannot run on CPU tensors"
    if device == "cuda" and backend == "triton" and _backend.triton_interpreting():
        return "TRITON_INTERPRET=1 runs the interpreter, not the GPU kernels"
    impl, why = _backend._availability(backend, torch.device(device))
    return None if impl is not None else why


@pytest.fixture(params=KERNEL_TARGETS, ids=[f"{d}-{b}" for d, b in KERNEL_TARGETS])
def target(request):
    """A (device, backend) pair to test against the torch reference; skipped when unavailable."""
    device, backend = request.param
    why = target_skip_reason(device, backend)
    if why and device == "cuda" and torch.cuda.is_available() and not _backend.triton_interpreting():
        pytest.fail(f"{backend} on {device} is unavailable on a machine with a GPU: {why}")
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device), backend


def is_interpreted(target) -> bool:
    """Triton under the interpreter is slow: tests use smaller sizes for it."""
    return target[1] == "triton" and target[0].type == "cpu"


# The distributed parity suite that also runs under the NCCL-rules backend
# (parallel_layers.testing.nccl_rules): test file -> {test function: substrings one of which its
# parameter id must hold, or "" for every case}. The rest of the suite runs on plain gloo only, so
# make test stays within its time budget; PL_TEST_BACKEND=nccl_rules runs everything under the rules.
UNDER_NCCL_RULES = {
    "test_pipeline.py": {"test_pipeline_matches_unpipelined_gpt": ("float32",),
                         "test_pipeline_evaluate_matches_dense_eval_loss": ("0.2",),
                         "test_pipeline_batch_shape_changes_between_steps": ("",)},
    "test_moe_3d.py": {"test_expert_parallel_gpt_trains_like_one_process": ("dp2ep2-zero1", "tp2ep2-sp-zero2")},
    "test_moe_hf_3d.py": {"test_hf_moe_models_train_with_expert_parallelism_like_one_process": ("pipeline",)},
    "test_3d_any_model.py": {"test_llama_sequence_parallel_matches_single_process": ("tp2-pp2",),
                             "test_default_loss_on_vocabulary_shards_matches_single_process": ("llama-tp2-pp2",)},
    "test_3d.py": {"test_3d_matches_single_process": ("",), "test_3d_zero3_matches_single_process": ("dims0",),
                   "test_3d_checkpoint_resumes_bit_identically_in_fresh_processes": ("zero2",)},
    "test_data_parallel.py": {"test_stage0_matches_single_process": ("",),
                              "test_no_sync_accumulation_equals_large_batch": ("",)},
    "test_dp_integration.py": {"test_tp2_x_dp2_zero2_matches_single_process": ("",)},
    "test_zero.py": {"test_parity_with_single_process_adamw": ("2-",)},
    "test_zero3.py": {"test_tp2_dp2_parity": ("",)},
    "test_zero3_fp8_gather.py": {"test_fp8_gather_trains_bit_identically": ("2-float32",),
                                 "test_fp8_gather_tp2_dp2_bit_identical": ("",)},
    "test_gpt_tp.py": {"test_gpt_tp_matches_dense": ("float32",)},
    "test_tp_layers.py": {"test_mlp_column_then_row_matches_dense": ("",)},
    "test_vocab_cross_entropy.py": {"test_parity_with_f_cross_entropy": ("2",)},
    "test_universal_checkpoint.py": {"test_universal_checkpoint_resumes_on_another_mesh": ("3d-zero1",)},
    "test_pipeline_any_model.py": {"test_hf_model_pipelined_matches_single_process": ("llama-interleaved",)},
    "test_3d_inferred.py": {"test_families_train_in_3d_with_no_recipe_like_one_process": ("tp2pp2-zero1-phi3-neox",
                                                                                        "tp2pp2-zero1-qk-norms")},
    "test_zero_offload.py": {"test_offload_trains_bit_identically_to_in_memory": ("3-",),
                             "test_bf16_gradient_shard_matches_the_fp32_one": ("",)},
    "test_zero_host_offload.py": {"test_gradients_are_reported_as_each_unit_or_bucket_is_reduced": ("",)},
    "test_freeze_training.py": {"test_fixed_schedule_relayout_pp4_to_dp2_pp2_matches_single_process": ("1",)},
    "test_parameter_server.py": {"test_sync_matches_single_process": ("2",)},
    "test_token_loss.py": {"test_gpt_loss_is_the_global_token_mean": ("microbatch",)},
    "test_context_parallel_attention.py": {"test_context_parallel_attention_matches_single_process": ("masked",)},
    "test_context_parallel_3d.py": {"test_context_parallel_in_4d_matches_single_process": ("qwen2",),
                                    "test_hf_model_with_context_parallel_matches_single_process": ("ulysses",)},
    "test_precision_3d.py": {"test_low_precision_model_through_the_pipeline": ("dp2-pp2-zero1",),
                             "test_zero3_low_precision_like_one_process": ("dp4-bf16",)},
    "test_zero2_backward_memory.py": {"test_parallel3d_zero2_streams_on_one_stage": ("2",)},
    "test_partitioned_checkpoint.py": {"test_partitioned_and_offloaded_inputs_equal_plain_checkpointing": ("",)},
    "test_moe_expert_parallel.py": {"test_expert_parallel_matches_one_process": ("ep2-fp32",)},
    "test_fp8_3d.py": {"test_fp8_layout_matches_one_process": ("dp2-tensor-z3", "tp2sp-delayed", "cp2-delayed")},
}


def _rules_filter(module_file: str, function: str):
    return UNDER_NCCL_RULES.get(os.path.basename(module_file), {}).get(function)


def pytest_generate_tests(metafunc):
    if "dist_pools" in metafunc.fixturenames and _rules_filter(metafunc.module.__file__, metafunc.function.__name__):
        metafunc.parametrize("dist_pools", ["gloo", "nccl_rules"], indirect=True)


# The tests `make test-fast` (pytest -m "not slow") leaves out and `make test` runs: each costs about 5 s or
# more on 2 cores because it starts 8 ranks, runs the demo or torchrun in subprocesses, runs a benchmark group
# end to end, builds or compiles the kernels, or allocates a 4 GiB tensor. Test file -> its slow test
# functions, or "*" for all of them. A name the file no longer defines is a collection error.
SLOW = {
    "test_planner_speed.py": ("test_the_fast_path_ranks_as_the_full_probe",),
    "test_planner_measure_output.py": ("test_a_block_freed_under_the_profiler_prints_no_allocator_warning",),
    "test_planner_gemm_curve.py": ("test_the_h200_profile_predicts_the_measured_training_step",),
    "test_replica_invariant.py": ("test_tied_weights_stay_bit_identical_at_dp4_and_train_like_one_process",
                                  "test_q_k_norms_train_like_one_process_at_tp2"),
    "test_3d.py": ("test_3d_matches_single_process", "test_3d_zero3_matches_single_process",
                   "test_3d_checkpointing_replays_dropout",
                   "test_3d_checkpoint_resumes_bit_identically_in_fresh_processes",
                   "test_3d_fp16_zero1_matches_fp32_single_process",
                   "test_3d_fp16_overflow_on_one_rank_skips_everywhere",
                   "test_demo_end_to_end", "test_demo_under_nccl_rules", "test_demo_under_torchrun"),
    "test_3d_any_model.py": ("test_hf_model_in_3d_matches_single_process",
                             "test_default_loss_on_vocabulary_shards_matches_single_process",
                             "test_bert_real_weights_mlm_in_3d_matches_single_process",
                             "test_llama_universal_checkpoint_resumes_at_another_layout",
                             "test_checkpointing_replays_dropout_bit_identically",
                             "test_skip_nonfinite_skips_on_every_rank_and_leaves_state_untouched",
                             "test_demo_trains_llama_through_the_same_path",
                             "test_3d_with_optimizer_state_on_disk_is_bit_identical",
                             "test_llama_sequence_parallel_matches_single_process"),
    "test_precision_3d.py": ("test_bf16_at_dp2_tp2_pp2", "test_bf16_autocast_over_fp32_weights",
                             "test_default_loss_on_vocabulary_shards_in_low_precision",
                             "test_low_precision_model_through_the_pipeline",
                             "test_zero3_low_precision_like_one_process", "test_zero3_bf16_at_dp2_tp2_pp2",
                             "test_zero3_bf16_qwen3_at_dp2_tp2",
                             "test_zero3_bf16_with_the_optimizer_state_on_disk", "test_zero3_bf16_checkpoints_resume",
                             "test_zero3_fp16_overflow_skips_on_every_rank",
                             "test_zero3_bf16_gpt_equals_zero1_and_takes_sequence_parallelism"),
    "test_zero2_backward_memory.py": ("test_parallel3d_zero2_streams_on_one_stage",
                                      "test_stage2_gradients_match_stage1",
                                      "test_parallel3d_zero3_gathers_unit_by_unit_on_one_stage"),
    "test_token_loss.py": ("test_gpt_loss_is_the_global_token_mean_at_dp2_tp2_pp2_zero3",
                           "test_user_loss_is_the_global_token_mean", "test_user_loss_replica_all_ignored_zero3"),
    "test_context_parallel_3d.py": ("test_context_parallel_in_4d_matches_single_process",
                                    "test_hf_context_parallel_with_sequence_parallel_matches_single_process",
                                    "test_mesh_places_cp_inside_dp", "test_demo_with_context_parallel",
                                    "test_hf_model_with_context_parallel_matches_single_process",
                                    "test_cp_run_with_checkpointing_resumes_without_cp_from_its_universal_checkpoint",
                                    "test_reference_gpt_with_context_parallel_matches_single_process",
        "test_bf16_model_with_context_parallel",),
    "test_3d_inferred.py": "*",
    "test_compile.py": ("test_parallel3d_inductor_matches_eager", "test_tp_pair_inductor_matches_eager_tp2",
                        "test_gpt_blocks_compile_without_break_tp2"),
    "test_universal_checkpoint.py": ("test_universal_checkpoint_resumes_on_another_mesh",
                                     "test_universal_checkpoint_fp16_carries_master_weights_and_scaler",
                                     "test_demo_saves_and_resumes_on_another_layout"),
    "test_bench_dp_zero.py": "*",
    "test_bench_scaling.py": "*",
    "test_bench_context_parallel.py": "*",
    "test_bench_moe.py": "*",
    "test_moe_3d.py": ("test_universal_checkpoint_reshards_experts_across_ep_sizes",
                       "test_demo_trains_the_moe_gpt_with_expert_parallelism"),
    "test_moe_hf_3d.py": ("test_hf_moe_models_train_with_expert_parallelism_like_one_process",),
    "test_fp8_3d.py": ("test_fp8_layout_matches_one_process", "test_demo_trains_in_fp8",
                       "test_fp8_delayed_scaling_resumes_bit_for_bit",
                       "test_hugging_face_llama_trains_in_fp8_like_one_process",
                       "test_zero3_fp8_all_gather_trains_bit_identically",
                       "test_universal_checkpoint_carries_the_delayed_histories_to_another_layout"),
    "test_zero3_fp8_gather.py": ("test_fp8_gather_trains_bit_identically", "test_fp8_gather_tp2_dp2_bit_identical",
                                 "test_other_recipes_gather_as_usual",
                                 "test_fp8_gather_under_checkpointing_and_held_mode"),
    "test_planner_fp8.py": ("test_fp8_step_is_faster_than_bf16_on_an_h100_at_a_gemm_dominated_shape",
                            "test_saved_bytes_are_what_fp8linear_keeps_on_cpu"),
    "test_bench_fp8_layers.py": "*",
    "test_bench_fp8_convergence.py": "*",
    "test_bench_train_step.py": "*",
    "test_wrappers_free_memory.py": "*",
    "test_planner_moe.py": ("test_predicted_parameter_bytes_are_what_a_real_rank_holds",
                            "test_ep_layouts_hold_their_share_of_the_experts_and_pay_all_to_alls"),
    "test_sync_batchnorm.py": ("test_benchmark_smoke_rows", "test_inside_data_parallel_trains_like_one_process"),
    "test_checkpoint_policy.py": ("test_benchmark_smoke",),
    "test_single_process_dp.py": ("test_benchmark_smoke_rows",
                                  "test_gpt_over_three_threads_equals_one_device_on_the_whole_batch"),
    "test_partitioned_checkpoint.py": ("test_partitioned_and_offloaded_inputs_equal_plain_checkpointing",
                                       "test_parallel3d_checkpoint_inputs_equal_plain_checkpointing"),
    "test_async_checkpoint.py": "*",
    "test_torchrun_restart.py": "*",
    "test_planner.py": ("test_meta_microbatch_equals_real_tensors", "test_schedule_in_flight_and_zero3",
                        "test_cli_json_and_png", "test_parallel3d_layout_auto",
                        "test_parallel_probes_rank_exactly_what_one_process_ranks",
                        "test_llama3_8b_zero2_fits_with_micro_batches_of_two_on_8x80gib",
                        "test_predicted_peak_is_the_measured_one_on_gloo_ranks",
                        "test_zero3_bf16_microbatch_on_meta_equals_real_tensors",
        "test_probe_twin_ranks_equal_their_own_probe",
        "test_zero3_of_a_bf16_model_is_planned_with_its_terms",
        "test_published_prediction_and_pick_run"),
    "test_zero_bubble.py": ("test_zero_bubble_3d_matches_single_process_pp2",
                            "test_zero_bubble_3d_matches_single_process_pp4", "test_zero_bubble_3d_under_nccl_rules"),
    "test_bench_kernels_tp.py": ("test_tp_smoke_rows", "test_cross_entropy_smoke_rows_and_environment_restored"),
    "test_benchmarks_smoke.py": ("test_kernels_smoke_prints_a_row_per_case",
                                 "test_bench_cli_rejects_unknown_group_and_lists_groups",
                                 "test_bench_suite_smoke_runs_a_group_end_to_end",
        "test_zero_memory_smoke_prints_a_row_per_method",),
    "test_vocab_cross_entropy.py": ("test_benchmark_smoke",),
    "test_zero.py": ("test_benchmark_smoke_prints_figures",),
    "test_extension.py": ("test_jit_build_when_not_prebuilt",),
    "test_gpu_check.py": ("test_dry_run_runs_and_writes_its_summary", "test_budget_step_limits_and_not_run_steps"),
    "test_zero_reshard.py": ("test_zero_state_resumes_at_another_dp_size",
        "test_load_full_state_dict_names_what_is_missing",),
    "test_cuda_compile.py": "*",
    "test_ops_large_index.py": "*",
    "test_readme.py": ("test_readme_example_runs",),
    "test_zero_offload.py": ("test_bf16_gradient_shard_halves_the_resident_gradient_memory",
                             "test_benchmark_smoke_rows", "test_resident_memory_is_bounded_by_the_buffers"),
    "test_zero_host_offload.py": ("test_cpu_adam_and_host_offload_benchmarks_smoke",),
    "test_freeze_training.py": ("test_demo_freeze_shows_the_layout_changing",
                                "test_hf_llama_freezes_through_its_recipe",
                                "test_benchmark_smoke_reports_time_to_the_same_loss"),
    "test_parameter_server.py": ("test_a_dead_worker_stops_a_sync_run_but_not_an_async_one",),
    "test_amp.py": ("test_fp16_overflow_is_agreed_skipped_backed_off_and_recovered",),
    "test_pipeline.py": ("test_a_rank_that_raises_fails_every_rank_within_the_timeout",),
    "test_mesh_and_mappings.py": ("test_a_failing_rank_fails_the_call_instead_of_hanging",),
    "test_faults.py": ("test_a_killed_or_stopped_rank_fails_the_others_within_the_timeout",),
    "test_cpu_affinity.py": ("test_more_ranks_than_cores_are_left_free",),
    "test_cpu_allocator.py": ("test_retained_memory_is_reused_without_page_faults",
                              "test_benchmark_ranks_start_with_the_retain_settings"),
    "test_schedules_registry.py": ("test_freeze_training_runs_zbv_with_two_chunks_a_rank",),
    "test_dp_integration.py": ("test_checkpoint_resumes_bit_identically_in_a_fresh_process_group",),
}


def _is_slow(item) -> bool:
    names = SLOW.get(os.path.basename(item.module.__file__))
    if names is None:
        return False
    if names != "*":
        gone = [n for n in names if not hasattr(item.module, n)]
        if gone:
            raise pytest.UsageError(f"tests/conftest.py SLOW names {gone}, which "
                                    f"{os.path.basename(item.module.__file__)} does not define; update the entry")
    return names == "*" or item.originalname in names


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, every test module: about a million objects) lives as long
    as the session: set aside from the garbage collector, so Python's own full collections walk only what the
    tests make (they took ~30% of the main process's time in the planner and kernel tests)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Mark the SLOW tests; keep the NCCL-rules variant only of the parameter cases its entry names."""
    kept = []
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        spec = getattr(item, "callspec", None)
        wanted = _rules_filter(item.module.__file__, item.originalname) if spec else None
        if wanted and spec.params.get("dist_pools") == "nccl_rules":
            rest = "-".join(p for p in spec.id.split("-") if p != "nccl_rules")
            if not any(w in rest for w in wanted):
                continue
        kept.append(item)
    items[:] = kept


@pytest.fixture(autouse=True)
def _backend_variable_read_anew():
    """The ops read ``PARALLEL_LAYERS_BACKEND`` once (``ops/_backend.py``): a test that changed it (monkeypatch,
    a fixture) must not leave its value cached for the tests after it."""
    if _backend.env_changed():
        _backend.clear_cache()
    yield
    if _backend.env_changed():
        _backend.clear_cache()


@pytest.fixture(scope="session")
def _pools():
    from parallel_layers.testing import WorkerPool

    pools = {}

    def get(world_size: int, backend: str) -> WorkerPool:
        if (world_size, backend) not in pools:
            pools[(world_size, backend)] = WorkerPool(world_size, backend=backend)
        return pools[(world_size, backend)]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def dist_pools(request, _pools):
    """``dist_pools(n)``: a pool of n ranks, started once per session and shared by every test: gloo, or
    the NCCL-rules backend for the variant of a test in ``UNDER_NCCL_RULES`` (or everywhere with
    ``PL_TEST_BACKEND=nccl_rules``); ``dist_pools(n, backend)`` names one."""
    default = getattr(request, "param", None) or os.environ.get("PL_TEST_BACKEND", "gloo")

    def get(world_size: int, backend: str = None):
        return _pools(world_size, backend or default)

    get.backend = default
    return get
