# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The ``sharded_rdt`` planner at full model size, without the weights.

For each case (a full-size config and a TP size) this starts one process per
TP rank; the ranks form a real gloo tensor-parallel group, as in the planner
checks. Each rank:

* builds the vLLM model class of the config on the meta device
  (`build_meta_model`: vLLM's ``initialize_model`` under ``torch.device("meta")``,
  so no parameter has storage and no checkpoint is read);
* lists the Hugging Face checkpoint the trainer would send, names and shapes
  computed from the config (`checkpoint_metas`), in the trainer's order;
* bakes its plan (`bake_worker_plan`), serializes it (``WorkerPlan.to_json``,
  compact JSON) and checks the JSON reads back to the same digest;
* cuts the plan into pulls (`build_pull_plan`, ``--producers`` trainer ranks
  that each hold every name).

The configs are written out by hand from the published model configs (sizes
only, no quantization): Qwen3-8B, Qwen3-30B-A3B, and DeepSeek-V3 in bf16 (its
fp8 block quantization left out, its multi-token-prediction layer not listed).
A plan baked on a meta model equals the one baked on the loaded model
(tests/distributed/weight_transfer/plan/test_planner_real_models.py), so these
are the plans the engine would bake.

Run: ``python benchmarks/weight_transfer/bench_plan_scale.py [--cases
qwen3-8b:1 qwen3-8b:2 ...] [--plans-dir /tmp/plans]``; the result goes to
``benchmarks/results/plan_scale/<device>.json``. With ``--plans-dir`` the plans of
the Qwen3 cases are written there as ``<model>_tp<N>_rank<R>.json`` (compact
``WorkerPlan.to_json``) for replay elsewhere.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _bench_common import (
    git_commit,
    machine_info,
    max_rss_bytes,
    result_path,
    write_json,
)

QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}

MODELS: dict[str, dict[str, Any]] = {
    "qwen3-8b": QWEN3_8B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v3-bf16": DEEPSEEK_V3,
}
DEFAULT_CASES = (
    "qwen3-8b:1",
    "qwen3-8b:2",
    "qwen3-30b-a3b:1",
    "qwen3-30b-a3b:2",
    "deepseek-v3-bf16:1",
    "deepseek-v3-bf16:8",
)
# Plans of these models are written to --plans-dir.
SAVED_PLAN_MODELS = ("qwen3-8b", "qwen3-30b-a3b")


def _dense_mlp(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple]]:
    return [
        (f"{prefix}.gate_proj.weight", (inter, hidden)),
        (f"{prefix}.up_proj.weight", (inter, hidden)),
        (f"{prefix}.down_proj.weight", (hidden, inter)),
    ]


def _qwen3_layer(c: dict[str, Any], i: int) -> list[tuple[str, tuple]]:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    p = f"model.layers.{i}"
    out: list[tuple[str, tuple]] = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
        (f"{p}.self_attn.q_norm.weight", (d,)),
        (f"{p}.self_attn.k_norm.weight", (d,)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
    ]
    sparse = (
        c["model_type"] == "qwen3_moe"
        and i not in c["mlp_only_layers"]
        and (i + 1) % c["decoder_sparse_step"] == 0
    )
    if not sparse:
        return out + _dense_mlp(f"{p}.mlp", h, c["intermediate_size"])
    out.append((f"{p}.mlp.gate.weight", (c["num_experts"], h)))
    for e in range(c["num_experts"]):
        out += _dense_mlp(f"{p}.mlp.experts.{e}", h, c["moe_intermediate_size"])
    return out


def _deepseek_v3_layer(c: dict[str, Any], i: int) -> list[tuple[str, tuple]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_rank, kv_rank = c["q_lora_rank"], c["kv_lora_rank"]
    p = f"model.layers.{i}"
    out: list[tuple[str, tuple]] = [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_a_proj.weight", (q_rank, h)),
        (f"{p}.self_attn.q_a_layernorm.weight", (q_rank,)),
        (f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_rank)),
        (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope, h)),
        (f"{p}.self_attn.kv_a_layernorm.weight", (kv_rank,)),
        (f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v), kv_rank)),
        (f"{p}.self_attn.o_proj.weight", (h, heads * v)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
    ]
    if i < c["first_k_dense_replace"] or i % c["moe_layer_freq"] != 0:
        return out + _dense_mlp(f"{p}.mlp", h, c["intermediate_size"])
    experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
    out.append((f"{p}.mlp.gate.weight", (experts, h)))
    out.append((f"{p}.mlp.gate.e_score_correction_bias", (experts,)))
    for e in range(experts):
        out += _dense_mlp(f"{p}.mlp.experts.{e}", h, inter)
    return out + _dense_mlp(f"{p}.mlp.shared_experts", h, inter * c["n_shared_experts"])


def checkpoint_metas(config: dict[str, Any]) -> list[Any]:
    """``ParamMeta`` of every tensor of the Hugging Face checkpoint of
    ``config`` (dense Qwen3, Qwen3-MoE, DeepSeek-V3 without its fp8 scales and
    its multi-token-prediction layer), in the order a trainer lists them:
    embeddings, decoder layers, final norm, head."""
    import torch

    from vllm.distributed.weight_transfer.base import ParamMeta

    layer = {
        "qwen3": _qwen3_layer,
        "qwen3_moe": _qwen3_layer,
        "deepseek_v3": _deepseek_v3_layer,
    }[config["model_type"]]
    h, vocab = config["hidden_size"], config["vocab_size"]
    entries: list[tuple[str, tuple]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(config["num_hidden_layers"]):
        entries += layer(config, i)
    entries.append(("model.norm.weight", (h,)))
    if not config["tie_word_embeddings"]:
        entries.append(("lm_head.weight", (vocab, h)))
    dtype = getattr(torch, config["torch_dtype"])
    return [
        ParamMeta(
            name,
            # The routing bias is kept in float32 in DeepSeek-V3's checkpoint.
            torch.float32 if name.endswith("e_score_correction_bias") else dtype,
            shape,
        )
        for name, shape in entries
    ]


def _rank_main(
    rank: int,
    tp: int,
    port: int,
    model_name: str,
    folder: str,
    producers: int,
    plans_dir: str | None,
    queue: Any,
) -> None:
    result: dict[str, Any] = {"model": model_name, "tp": tp, "rank": rank}
    try:
        started = time.perf_counter()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ["VLLM_DIST_IDENT"] = f"plan-scale-{port}"
        import torch

        torch.set_num_threads(1)
        from vllm.distributed.weight_transfer.plan.bake import (
            bake_worker_plan,
        )
        from vllm.distributed.weight_transfer.plan.worker_plan import WorkerPlan
        from vllm.distributed.weight_transfer.pull.chunks import (
            build_pull_plan,
        )
        from vllm.distributed.weight_transfer.pull.routing import RdtRouter
        from vllm.distributed.weight_transfer.sharded_rdt.lander import (
            deferred_modules,
        )
        from vllm.distributed.weight_transfer.testing.sharded_rdt_checks import (
            _init_distributed,
            _shutdown_distributed,
            build_meta_model,
        )

        config = MODELS[model_name]
        try:
            _init_distributed(rank, tp, port, folder)
            result["startup_s"] = time.perf_counter() - started
            result["rss_after_startup_bytes"] = max_rss_bytes()

            t0 = time.perf_counter()
            model, vllm_config = build_meta_model(folder, config["torch_dtype"], tp)
            result["build_s"] = time.perf_counter() - t0
            result["non_meta_tensors"] = sum(
                1
                for t in list(model.parameters()) + list(model.buffers())
                if not t.is_meta
            )
            metas = checkpoint_metas(config)
            result["checkpoint_tensors"] = len(metas)
            result["model_bytes"] = sum(
                m.dtype.itemsize * int(torch.Size(m.shape).numel()) for m in metas
            )
            result["rss_before_bake_bytes"] = max_rss_bytes()

            worker = f"{model_name}/tp{rank}of{tp}"
            t0, cpu0 = time.perf_counter(), time.process_time()
            plan = bake_worker_plan(
                model, metas, worker=worker, vllm_config=vllm_config
            )
            result["bake_s"] = time.perf_counter() - t0
            # Ranks share the cores: CPU seconds are what one bake costs alone.
            result["bake_cpu_s"] = time.process_time() - cpu0

            copies = plan.copies
            result["copies"] = len(copies)
            result["regions"] = len({c.region for c in copies})
            result["slices"] = sum(len(g.slices) for g in plan.groups)
            result["groups"] = len(plan.groups)
            result["unused_names"] = len(plan.unused_names)
            result["partial_modules"] = len(plan.partial_modules)
            # Modules the engine's init refuses to land (processed only at the
            # end of a reload); a nonempty list stops a real sharded_rdt init.
            result["deferred_modules"] = deferred_modules(model, plan)

            t0 = time.perf_counter()
            digest = plan.digest()
            result["digest_s"] = time.perf_counter() - t0
            result["digest"] = digest
            t0 = time.perf_counter()
            text = json.dumps(plan.to_json(), separators=(",", ":"))
            result["to_json_s"] = time.perf_counter() - t0
            result["plan_bytes"] = len(text.encode())
            result["plan_gzip_bytes"] = len(gzip.compress(text.encode()))
            result["dump_bytes"] = len(plan.dump().encode())
            t0 = time.perf_counter()
            result["json_roundtrip_ok"] = (
                WorkerPlan.from_json(json.loads(text)).digest() == digest
            )
            result["from_json_s"] = time.perf_counter() - t0
            if plans_dir and model_name in SAVED_PLAN_MODELS:
                path = Path(plans_dir) / f"{model_name}_tp{tp}_rank{rank}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                result["plan_file"] = str(path)

            t0 = time.perf_counter()
            pulls = build_pull_plan(
                plan, RdtRouter(producers, tp, workers_per_replica=tp), rank
            )
            result["pull_plan_s"] = time.perf_counter() - t0
            result["producers"] = producers
            result["chunks"] = len(pulls.chunks)
            result["max_chunk_bytes"] = pulls.max_chunk_bytes
            result["rank_payload_bytes"] = pulls.payload_bytes
            result["plan_nbytes"] = plan.nbytes
        finally:
            _shutdown_distributed()
    except Exception:
        result["error"] = traceback.format_exc()
    result["peak_rss_bytes"] = max_rss_bytes()
    result["process_s"] = time.perf_counter() - started
    queue.put(result)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_case(
    model_name: str,
    tp: int,
    producers: int,
    plans_dir: str | None,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """One process per rank; returns each rank's result, by rank."""
    import multiprocessing

    with tempfile.TemporaryDirectory(prefix=f"plan-scale-{model_name}-") as folder:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(MODELS[model_name], f, indent=2)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, tp, port, model_name, folder, producers, plans_dir, queue),
                daemon=True,
            )
            for rank in range(tp)
        ]
        started = time.perf_counter()
        for proc in procs:
            proc.start()
        results = []
        try:
            for _ in procs:
                results.append(queue.get(timeout=timeout_s))
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
        wall = time.perf_counter() - started
    for r in results:
        r["case_wall_s"] = wall
    return sorted(results, key=lambda r: r["rank"])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':<17} {'tp':>2} {'rank':>4} {'bake_s':>7} {'copies':>7} "
        f"{'regions':>7} {'plan_MiB':>8} {'pull_s':>7} {'chunks':>6} "
        f"{'payload_GiB':>11} {'model_GiB':>9} {'peak_rss_GiB':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<17} {r['tp']:>2} {r['rank']:>4} ERROR")
            continue
        print(
            f"{r['model']:<17} {r['tp']:>2} {r['rank']:>4} {r['bake_s']:>7.2f} "
            f"{r['copies']:>7} {r['regions']:>7} "
            f"{r['plan_bytes'] / 2**20:>8.2f} {r['pull_plan_s']:>7.3f} "
            f"{r['chunks']:>6} {_gib(r['rank_payload_bytes']):>11} "
            f"{_gib(r['model_bytes']):>9} {_gib(r['peak_rss_bytes']):>12}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="+",
        default=list(DEFAULT_CASES),
        help=f"model:tp pairs; models: {', '.join(MODELS)}",
    )
    parser.add_argument(
        "--producers",
        type=int,
        default=1,
        help="trainer ranks serving the pulls, each holding every name",
    )
    parser.add_argument("--plans-dir", default=None)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", default=str(result_path(__file__)))
    args = parser.parse_args()

    started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        model_name, tp = case.split(":")
        print(f"== {model_name} TP {tp}", file=sys.stderr, flush=True)
        rows += run_case(
            model_name, int(tp), args.producers, args.plans_dir, args.timeout
        )
    print_table(rows)
    doc = {
        "benchmark": "plan_scale_cpu",
        "commit": git_commit(),
        "time_utc_start": started_utc,
        "time_utc_end": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "producers": args.producers,
        "models": MODELS,
        "cases": rows,
    }
    if args.out:
        write_json(doc, args.out)


if __name__ == "__main__":
    main()
