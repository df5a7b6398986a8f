"""A Hugging Face ``transformers`` model as a rollout: probed through ``from_pretrained`` itself.

The probe's load function writes each pass's id-encoded checkpoint as safetensors and loads it
with ``AutoModelForCausalLM.from_pretrained``, the whole path a user runs (transformers 5 fuses
the experts of Qwen3-MoE into stacked tensors on the way); the maps say where every checkpoint
element lands in the model's parameters. A plan then moves a trainer's weights into a model made
by ``from_pretrained`` of other weights, and every parameter is checked against
``from_pretrained`` of the trainer's.

    python examples/hf_transformers_rollout.py      # needs torch, transformers 5, safetensors
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file

import wb
import wb_torch
from wb.layouts.presets import TINY, spec_from_config
from wb.data.dtypes import canonical_dtype, dtype_info


def hf_config(cfg: dict):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        moe_intermediate_size=cfg["moe_intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
        mlp_only_layers=list(range(cfg["first_k_dense_replace"])), tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"], dtype="bfloat16")


def from_pretrained(ckpt: dict, folder: Path, cfg: dict):
    """``AutoModelForCausalLM.from_pretrained`` of the checkpoint ``ckpt`` (numpy arrays)."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    hf_config(cfg).save_pretrained(folder)
    save_file({n: np.ascontiguousarray(a) for n, a in ckpt.items()},
              str(folder / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)


def random_checkpoint(spec: wb.CheckpointSpec, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(spec.shape(n), dtype=np.float32).astype(
        dtype_info(spec.dtype(n)).numpy) for n in spec.names}


def main(cfg: dict = TINY) -> bool:
    spec = spec_from_config(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        passes = iter(range(1000))

        def load(ck):  # the probe's load: from_pretrained of the id-encoded checkpoint
            model = from_pretrained({n: np.asarray(ck[n]) for n in ck}, tmp / f"p{next(passes)}",
                                    cfg)
            return {n: wb_torch.to_numpy(p) for n, p in model.state_dict().items()}

        maps = wb.probe(spec, load)
        rollout = from_pretrained(random_checkpoint(spec, 1), tmp / "rollout", cfg)
        params = dict(rollout.state_dict())
        dtypes = {n: canonical_dtype(p.dtype) for n, p in params.items()}
        lay = wb.Layout(wb.Worker(1, "r0", "rollout"),
                        {n: wb.BufferSpec(m, dtypes[n]) for n, m in maps.items() if m.n_ids})
        trainer = wb.Layout(wb.Worker(0, "t0", "trainer"), {
            n: wb.BufferSpec(wb.SourceMap.from_indices(spec.ids(n).reshape(spec.shape(n))),
                             spec.dtype(n)) for n in spec})
        plan = wb.plan([trainer], [lay])
        weights = random_checkpoint(spec, 2)
        wb.run_local(plan, {0: weights},
                     {1: {n: wb_torch.to_numpy(params[n]) for n in lay.buffers}})  # in place
        want = from_pretrained(weights, tmp / "want", cfg).state_dict()
        same = all(torch.equal(params[n].view(torch.uint8), want[n].view(torch.uint8))
                   for n in lay.buffers)
        print(f"{type(rollout).__name__}: {len(lay.buffers)} parameters mapped "
              f"({sorted(lay.buffers)[:2]}...); after the transfer, equal to from_pretrained "
              f"of the trainer's weights: {same}")
        return same


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
