# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tiny Hugging Face model folders generated locally, for tests, examples and
benchmarks that must not download anything.

`build_tiny_model(spec)` writes a complete model folder (config, safetensors weights,
a byte-level BPE tokenizer) and returns its path. Folders are cached by the spec's
digest, so every process that asks for the same spec shares one folder; they are
written to a temporary name and renamed, so concurrent builders never see a partial
folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

Architecture = Literal["qwen3", "qwen3_moe", "llama"]

# Bumped when the generated folder's content changes for an unchanged spec.
_FORMAT_VERSION = 1

_TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reinforcement learning pushes fresh weights into inference engines.",
    "A trainer computes gradients; the optimizer updates every parameter.",
    "vLLM serves tokens while the policy keeps improving step after step.",
    "Weights move through shared memory, CUDA IPC, NIXL or Ray.",
    "0123456789 +-*/=()[]{}<>.,;:!?'\"",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a generated model. Defaults give about 0.56 M parameters."""

    arch: Architecture = "qwen3"
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 1024
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    tie_word_embeddings: bool = False
    dtype: Literal["float32", "bfloat16"] = "float32"
    seed: int = 0
    init_std: float = 0.08
    max_position_embeddings: int = 512

    def digest(self) -> str:
        payload = json.dumps(
            {"format": _FORMAT_VERSION, **dataclasses.asdict(self)}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:12]

    @property
    def name(self) -> str:
        return f"tiny-{self.arch.replace('_', '-')}-{self.digest()}"


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_FORK_TINY_MODELS")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "vllm-fork" / "tiny-models"


def hf_config(spec: TinyModelSpec):
    """The transformers config object for ``spec``."""
    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if spec.arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if spec.arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
    if spec.arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny model architecture {spec.arch!r}")


def randomize_weights_(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Redraw every parameter of ``model`` in place from a seeded generator.

    Matrices get N(0, std); vectors (norm weights) get 1 + N(0, std / 4) so the
    network stays well conditioned and its greedy output is not degenerate.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() >= 2:
                value = noise * std
            else:
                value = 1.0 + noise * (std / 4)
            param.copy_(value.to(param.dtype))


def build_hf_model(spec: TinyModelSpec):
    """An in-memory HF causal LM for ``spec`` with the spec's seeded weights."""
    import torch
    from transformers import AutoModelForCausalLM

    config = hf_config(spec)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights_(model, spec.seed, spec.init_std)
    return model.to(getattr(torch, spec.dtype)).eval()


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def build_tiny_model(
    spec: TinyModelSpec | None = None, root: Path | None = None
) -> Path:
    """Return the folder of ``spec``'s model, generating it on first use."""
    spec = spec or TinyModelSpec()
    root = Path(root) if root is not None else default_cache_dir()
    target = root / spec.name
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        model = build_hf_model(spec)
        model.save_pretrained(tmp, safe_serialization=True)
        build_tokenizer(spec.vocab_size).save_pretrained(tmp)
        (tmp / "tiny_model_spec.json").write_text(
            json.dumps(dataclasses.asdict(spec), indent=2)
        )
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise  # not a lost race with another builder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_hf_model(model_dir: Path | str, dtype: str | None = None):
    """Load a generated folder back as an HF model (eval mode, on CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": getattr(torch, dtype)} if dtype else {"dtype": "auto"}
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs).eval()
