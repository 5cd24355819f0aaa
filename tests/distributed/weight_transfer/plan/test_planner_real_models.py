# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The planner on real vLLM model classes: dense Qwen3, Qwen3-MoE and Llama
(fused QKV and gate/up), fp32 and bf16, at TP=1 and on each rank of TP=2.

A plan baked on the same model class built on the meta device (no weights
anywhere) must be the plan baked on the loaded model: this is what lets a
full-size config be planned on a machine that could not hold its weights
(benchmarks/weight_transfer/bench_plan_scale.py).

Each TP size runs once per module in worker processes that form a real gloo
tensor-parallel group (`run_planner_checks`); the tests read their reports.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import (
    PlannerCase,
    run_planner_checks,
)

pytestmark = pytest.mark.slow

CASES = [
    PlannerCase(arch, dtype)
    for arch in ("qwen3", "qwen3_moe", "llama")
    for dtype in ("float32", "bfloat16")
]


@pytest.fixture(scope="module")
def reports():
    """``reports[tp_size][rank][case index]``; both sizes run concurrently."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {tp: pool.submit(run_planner_checks, tp, CASES) for tp in (1, 2)}
        return {tp: future.result() for tp, future in futures.items()}


def _all(reports):
    for tp, ranks in reports.items():
        for rank_reports in ranks:
            for report in rank_reports:
                assert not report.error, report.error
                yield f"{report.arch}/{report.dtype}/tp{tp}/rank{report.rank}", report


def test_landing_the_plan_fills_parameters_exactly_like_load_weights(reports):
    for label, report in _all(reports):
        assert report.compared_tensors > 20, label
        assert report.landing_mismatches == [], label


def test_bake_leaves_every_parameter_and_buffer_untouched(reports):
    for label, report in _all(reports):
        assert report.restore_mismatches == [], label


def test_plan_bytes_equal_the_bytes_load_weights_fills(reports):
    for label, report in _all(reports):
        assert report.plan_nbytes == report.filled_nbytes, label
        assert report.unused_names == [], label


def _replicated(name):
    return "norm" in name or name.endswith("mlp.gate.weight")


def test_each_tp2_rank_pulls_half_the_sharded_and_all_replicated_weights(reports):
    for case_index, case in enumerate(CASES):
        ranks = [rank_reports[case_index] for rank_reports in reports[2]]
        full = ranks[0].full_bytes_by_source
        for report in ranks:
            label = f"{case.arch}/{case.dtype}/rank{report.rank}"
            for name, nbytes in full.items():
                pulled = report.bytes_by_source.get(name, 0)
                expected = nbytes if _replicated(name) else nbytes // 2
                assert pulled == expected, (label, name, pulled, nbytes)
        tp1 = reports[1][0][case_index]
        assert tp1.bytes_by_source == full, case
        sharded = sum(n for name, n in full.items() if not _replicated(name))
        replicated = sum(n for name, n in full.items() if _replicated(name))
        assert ranks[0].plan_nbytes == sharded // 2 + replicated


def test_digest_is_stable_across_bakes_and_differs_between_ranks(reports):
    for label, report in _all(reports):
        assert report.digest == report.second_digest, label
    for case_index, case in enumerate(CASES):
        rank0, rank1 = (r[case_index].digest for r in reports[2])
        assert rank0 != rank1, case


def test_a_partly_covered_module_is_reported_by_name(reports):
    for label, report in _all(reports):
        (partial,) = report.partial_modules
        assert partial.startswith("model.layers.0.self_attn.qkv_proj: "), label
        assert "model.layers.0.self_attn.qkv_proj" in report.incomplete_error, label


def test_meta_model_parameters_have_no_storage(reports):
    for label, report in _all(reports):
        assert report.meta_param_devices == ["meta"], label
        # Only the rotary cache is real: vLLM shares one rotary module between
        # models of equal rope settings, and the loaded model made it first.
        for name in report.meta_model_real_buffers:
            assert name.endswith("rotary_emb.cos_sin_cache"), (label, name)


def test_plan_baked_on_meta_equals_plan_baked_on_loaded_model(reports):
    for label, report in _all(reports):
        assert report.digest, label
        assert report.meta_digest == report.digest, (
            label,
            report.dump,
            report.meta_dump,
        )


def test_ranks_get_different_plans_on_meta_too(reports):
    for case_index in range(len(CASES)):
        ranks = [rank_reports[case_index] for rank_reports in reports[2]]
        assert ranks[0].meta_digest != ranks[1].meta_digest
