"""The layers of :class:`wb_torch.testing.TinyRollout`: vLLM-style parameters with a
``weight_loader`` each, and the modules that hold them, sharded for one tensor-parallel rank
(with their block-scaled FP8 variant). The layout decisions are stated in
:mod:`wb_torch.testing`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import torch
from torch import nn

from wb.layouts import VOCAB_PADDING, ModelDims

__all__ = ["copy_into", "load_replicated", "load_vocab_rows", "load_columns", "load_qkv", "load_merged", "load_expert", "parameter", "Weight", "linear", "scale_blocks", "need_blocks", "KVCacheScales", "SelfAttention", "DenseMLP", "FusedExperts", "SharedFusedMoE", "MoE", "DecoderLayer", "Model", "vocab_parallel"]


# --- weight loaders (vLLM attaches one to each parameter as `param.weight_loader`) ---------------
def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    # copy_ broadcasts, so a wrong slice would be silently smeared over the parameter: refuse it.
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: slice of shape {tuple(src.shape)} does not fit the parameter "
                         f"region of shape {tuple(dst.shape)}")
    dst.copy_(src)


def load_replicated(param: nn.Parameter, loaded: torch.Tensor) -> None:
    copy_into(param.data, loaded, "replicated parameter")


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, *, start: int) -> None:
    # Rows at or past the real vocabulary are padding: this rank may hold a few or none of the
    # real rows, and its padding rows keep whatever they held.
    n = max(0, min(param.shape[0], loaded.shape[0] - start))
    copy_into(param.data[:n], loaded[start:start + n], "vocab-parallel rows")


def load_columns(param: nn.Parameter, loaded: torch.Tensor, *, start: int) -> None:
    width = param.shape[1]
    copy_into(param.data, loaded[:, start:start + width], "row-parallel input columns")


def load_qkv(param: nn.Parameter, loaded: torch.Tensor, shard_id: str, *,
              shards: Mapping[str, tuple[int, int, int]]) -> None:
    # shards[shard_id] = (first parameter row, first checkpoint row, rows)
    dst, src, n = shards[shard_id]
    copy_into(param.data[dst:dst + n], loaded[src:src + n], f"qkv_proj shard {shard_id!r}")


def load_merged(param: nn.Parameter, loaded: torch.Tensor, shard_id: int, *, rows: int,
                 start: int) -> None:
    copy_into(param.data[shard_id * rows:(shard_id + 1) * rows], loaded[start:start + rows],
          f"gate_up_proj shard {shard_id}")


def load_expert(param: nn.Parameter, loaded: torch.Tensor, weight_name: str, *, shard_id: str,
                 expert_id: int, first_expert: int, inter: int) -> bool:
    """vLLM FusedMoE loader: returns False (writes nothing) for an expert of another rank."""
    local = expert_id - first_expert
    if not 0 <= local < param.shape[0]:
        return False
    if shard_id == "w2":
        dst = param.data[local]
    else:  # w13 holds gate_proj (w1) then up_proj (w3)
        dst = param.data[local, :inter] if shard_id == "w1" else param.data[local, inter:]
    copy_into(dst, loaded, f"{weight_name} -> expert {expert_id} {shard_id}")
    return True


# --- modules -------------------------------------------------------------------------------------
def parameter(shape: tuple[int, ...], loader: Callable, *, dtype: torch.dtype,
               device) -> nn.Parameter:
    data = torch.empty(shape, dtype=dtype, device=device)
    # All-zero bits are 0.0 in every float format; fill_ is not implemented for float8 on CPU.
    data.view(torch.uint8).zero_()
    param = nn.Parameter(data, requires_grad=False)
    param.weight_loader = loader
    return param


class Weight(nn.Module):
    """One parameter named ``weight``: vLLM's linear layers, norms and embeddings, minus compute."""

    def __init__(self, shape: tuple[int, ...], loader: Callable, *, dtype: torch.dtype, device):
        super().__init__()
        self.weight = parameter(shape, loader, dtype=dtype, device=device)


def linear(shape: tuple[int, int], loader: Callable, scale_loader: Callable | None, *,
            fp8, dtype, device) -> Weight:
    """A linear layer's weight; with ``fp8`` (a block ``(bh, bw)``) in float8_e4m3fn beside a
    float32 ``weight_scale_inv`` of one scale per block, loaded by ``scale_loader`` (the
    weight's loader in block units), as vLLM's block-quantised FP8 linear methods keep them."""
    if fp8 is None:
        return Weight(shape, loader, dtype=dtype, device=device)
    m = Weight(shape, loader, dtype=torch.float8_e4m3fn, device=device)
    m.weight_scale_inv = parameter(scale_blocks(shape, fp8), scale_loader, dtype=torch.float32,
                                    device=device)
    return m


def scale_blocks(shape: tuple[int, ...], fp8) -> tuple[int, ...]:
    """The scales' shape of a weight (leading expert axis kept); its last two dims must split
    into whole blocks (as vLLM requires of a TP shard of a block-quantised weight)."""
    (bh, bw), (rows, cols) = fp8, shape[-2:]
    if rows % bh or cols % bw:
        raise ValueError(f"a weight shard of shape {tuple(shape)} does not split into whole "
                         f"{bh}x{bw} blocks; choose a block that divides every shard (or a "
                         f"smaller tp_size)")
    return (*shape[:-2], rows // bh, cols // bw)


def need_blocks(fp8, *sizes: int) -> None:
    if fp8 is not None and any(n % b for n in sizes for b in fp8):
        raise ValueError(f"TP shard offsets {sizes} do not fall on {fp8[0]}x{fp8[1]} block "
                         f"boundaries; choose a block that divides them (or a smaller tp_size)")


class KVCacheScales(nn.Module):
    """vLLM's ``Attention`` module: an fp8 kv-cache scale that is not in the checkpoint."""

    def __init__(self, device):
        super().__init__()
        self.k_scale = nn.Parameter(torch.ones(1, dtype=torch.float32, device=device),
                                    requires_grad=False)


class SelfAttention(nn.Module):
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, *, fp8=None, **kw):
        super().__init__()
        h, hd, nh, kv = d.hidden, d.head_dim, d.heads, d.kv_heads
        nq = nh // tp_size
        kv_local = max(1, kv // tp_size)
        kv_shard = tp_rank // max(1, tp_size // kv)  # which group of kv_local heads this rank holds
        shards = {"q": (0, tp_rank * nq * hd, nq * hd),
                  "k": (nq * hd, kv_shard * kv_local * hd, kv_local * hd),
                  "v": ((nq + kv_local) * hd, kv_shard * kv_local * hd, kv_local * hd)}
        need_blocks(fp8, *(x for sh in shards.values() for x in sh), tp_rank * nq * hd)
        bh, bw = fp8 or (1, 1)
        self.qkv_proj = linear(((nq + 2 * kv_local) * hd, h),
                                functools.partial(load_qkv, shards=shards),
                                functools.partial(load_qkv, shards={
                                    k: tuple(x // bh for x in v) for k, v in shards.items()}),
                                fp8=fp8, **kw)
        self.o_proj = linear((h, nq * hd),
                              functools.partial(load_columns, start=tp_rank * nq * hd),
                              functools.partial(load_columns, start=tp_rank * nq * hd // bw),
                              fp8=fp8, **kw)
        self.q_norm = Weight((hd,), load_replicated, **kw)
        self.k_norm = Weight((hd,), load_replicated, **kw)
        self.attn = KVCacheScales(kw["device"])


class DenseMLP(nn.Module):
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, *, fp8=None, **kw):
        super().__init__()
        h, n = d.hidden, d.intermediate // tp_size
        need_blocks(fp8, n, tp_rank * n)
        bh, bw = fp8 or (1, 1)
        self.gate_up_proj = linear(
            (2 * n, h), functools.partial(load_merged, rows=n, start=tp_rank * n),
            functools.partial(load_merged, rows=n // bh, start=tp_rank * n // bh), fp8=fp8, **kw)
        self.down_proj = linear((h, n), functools.partial(load_columns, start=tp_rank * n),
                                 functools.partial(load_columns, start=tp_rank * n // bw),
                                 fp8=fp8, **kw)


class FusedExperts(nn.Module):
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, *, dtype, device, fp8=None):
        super().__init__()
        h, mi = d.hidden, d.moe_intermediate
        n = d.experts // tp_size
        loader = functools.partial(load_expert, first_expert=tp_rank * n, inter=mi)
        wdt = dtype if fp8 is None else torch.float8_e4m3fn
        self.w13_weight = parameter((n, 2 * mi, h), loader, dtype=wdt, device=device)
        self.w2_weight = parameter((n, h, mi), loader, dtype=wdt, device=device)
        if fp8 is not None:  # vLLM's FusedMoE block-FP8: one scale per block of each expert
            need_blocks(fp8, mi)
            sl = functools.partial(load_expert, first_expert=tp_rank * n, inter=mi // fp8[0])
            self.w13_weight_scale_inv = parameter(scale_blocks((n, 2 * mi, h), fp8), sl,
                                                   dtype=torch.float32, device=device)
            self.w2_weight_scale_inv = parameter(scale_blocks((n, h, mi), fp8), sl,
                                                  dtype=torch.float32, device=device)


class SharedFusedMoE(nn.Module):  # vLLM 0.33 keeps the fused experts one level down
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, **kw):
        super().__init__()
        self.routed_experts = FusedExperts(d, tp_rank, tp_size, **kw)


class MoE(nn.Module):
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, *, fp8=None, **kw):
        super().__init__()
        self.gate = Weight((d.experts, d.hidden), load_replicated, **kw)
        self.experts = SharedFusedMoE(d, tp_rank, tp_size, fp8=fp8, **kw)


class DecoderLayer(nn.Module):
    def __init__(self, d: ModelDims, dense: bool, tp_rank: int, tp_size: int, *, fp8=None,
                 **kw):
        super().__init__()
        self.input_layernorm = Weight((d.hidden,), load_replicated, **kw)
        self.self_attn = SelfAttention(d, tp_rank, tp_size, fp8=fp8, **kw)
        self.post_attention_layernorm = Weight((d.hidden,), load_replicated, **kw)
        self.mlp = (DenseMLP if dense else MoE)(d, tp_rank, tp_size, fp8=fp8, **kw)


class Model(nn.Module):
    def __init__(self, d: ModelDims, tp_rank: int, tp_size: int, *, fp8=None, **kw):
        super().__init__()
        self.embed_tokens = vocab_parallel(d, tp_rank, tp_size, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer(d, i < d.n_dense, tp_rank, tp_size, fp8=fp8, **kw)
            for i in range(d.layers))
        self.norm = Weight((d.hidden,), load_replicated, **kw)


def vocab_parallel(d: ModelDims, tp_rank: int, tp_size: int, **kw) -> Weight:
    rows = d.padded_vocab(VOCAB_PADDING) // tp_size
    return Weight((rows, d.hidden), functools.partial(load_vocab_rows, start=tp_rank * rows),
                   **kw)
