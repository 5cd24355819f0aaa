# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A plan baked on a model built on the meta device (no weights anywhere) is
the plan baked on the same model loaded with its weights: equal digests for
dense Qwen3, Qwen3-MoE and Llama, fp32 and bf16, at TP=1 and on each rank of
TP=2. This is what lets a full-size config be planned on a machine that could
not hold its weights (benchmarks/weight_transfer/bench_plan_scale.py).

Each TP size runs in worker processes forming a real gloo tensor-parallel group
(`run_planner_checks` with `check_meta_bake`).
"""

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import (
    PlannerCase,
    check_meta_bake,
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
        futures = {
            tp: pool.submit(run_planner_checks, tp, CASES, check=check_meta_bake)
            for tp in (1, 2)
        }
        return {tp: future.result() for tp, future in futures.items()}


def _all(reports):
    for tp, ranks in reports.items():
        for rank_reports in ranks:
            for report in rank_reports:
                assert not report.error, report.error
                yield f"{report.arch}/{report.dtype}/tp{tp}/rank{report.rank}", report


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


def test_ranks_get_different_plans(reports):
    for case_index in range(len(CASES)):
        ranks = [rank_reports[case_index] for rank_reports in reports[2]]
        assert ranks[0].meta_digest != ranks[1].meta_digest
