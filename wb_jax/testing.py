"""A tiny JAX trainer for tests and demos: its parameter layout, load function and an oracle.

The trainer keeps its params as a pytree of sharded ``jax.Array`` leaves in JAX conventions, which
differ from the Hugging Face checkpoint that :func:`wb.layouts.presets.spec_from_config` describes: kernels
are ``[in, out]`` (the transpose of PyTorch's ``[out, in]``), attention projections are split per
head, gate and up projections are fused on a new leading axis, experts are stacked, and the
vocabulary is padded with zero rows so that it shards evenly over ``tp``. Some leaves are also
sharded over ``dp`` (FSDP-like) and others are replicated over it, so a sender meets both kinds of
holder.

:func:`make_load_fn` builds the trainer's ``load(ckpt) -> params``: the function a probe traces to
learn which checkpoint element every trainer buffer holds. :func:`expected_maps` is the answer the
probe must find, computed independently with numpy only, so tests can compare the two exactly.

Layout (``h`` hidden size, ``nh``/``kv`` attention/key-value heads, ``hd`` head dim, ``E`` experts,
``mi`` expert intermediate size, ``I`` dense intermediate size, ``Vp`` vocabulary rounded up to a
multiple of ``8 * tp``)::

    embed       [Vp, h]          P("tp", None)       embed_tokens.weight, zero padding rows
    layers[i]   input_norm [h], post_norm [h]        P()
      attn      q [h, nh, hd]    P("dp", "tp", None) q_proj.weight.T reshaped
                k, v [h, kv, hd] P(None, "tp", None) if tp divides kv, else P()
                o [nh, hd, h]    P("tp", None, "dp") o_proj.weight.T reshaped
                q_norm, k_norm [hd]                  P()
      mlp       dense (i < first_k_dense_replace):
                gate_up [2, h, I]     P(None, "dp", "tp")     stack([gate.T, up.T])
                down [I, h]           P("tp", None)
                MoE:
                router [h, E]         P()                     gate.weight.T
                gate_up [2, E, h, mi] P(None, "tp", None, None)
                down [E, mi, h]       P("tp", "dp", None)
    final_norm  [h]              P()
    lm_head     [h, Vp]          P(None, "tp")       lm_head.weight.T, zero padding columns
                                                     (absent when tie_word_embeddings)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import wb
from wb.data.dtypes import dtype_info
from wb.layouts import TINY, ModelDims, spec_from_config

__all__ = ["make_mesh", "make_load_fn", "expected_maps", "checkpoint_arrays"]

#: The vocabulary is padded to a multiple of ``VOCAB_MULTIPLE * tp`` rows, as JAX trainers pad it
#: so every tp shard of the embedding and of the logits is the same, lane-aligned size.
VOCAB_MULTIPLE = 8


def _dims(cfg: Mapping) -> ModelDims:
    """The dimensions of ``cfg``, which must be a qwen3_moe config (wb.SpecError otherwise)."""
    arch = cfg.get("architecture")
    if arch != "qwen3_moe":
        raise wb.SpecError(
            f"`cfg['architecture']` is {arch!r}; the JAX reference trainer models only "
            f"'qwen3_moe' (GQA attention with per-head norms), so pass a qwen3_moe config "
            f"such as wb.layouts.TINY")
    return ModelDims.of(cfg)


def _check_fits(d: ModelDims, dp: int, tp: int) -> None:
    """Raises one wb.SpecError listing every leaf dimension that dp or tp does not divide."""
    rules = [(d.hidden, "hidden_size", "dp", dp, "`attn.q`, `attn.o` and a dense `mlp.gate_up` "
              "shard h over dp"),
             (d.heads, "num_attention_heads", "tp", tp,
              "`attn.q` and `attn.o` shard heads over tp")]
    if d.n_dense:
        rules.append((d.intermediate, "intermediate_size", "tp", tp,
                      "dense `mlp.gate_up` and `mlp.down` shard I over tp"))
    if d.has_moe:
        rules.append((d.experts, "num_experts", "tp", tp,
                      "MoE `mlp.gate_up` and `mlp.down` shard experts over tp"))
        rules.append((d.moe_intermediate, "moe_intermediate_size", "dp", dp,
                      "MoE `mlp.down` shards mi over dp"))
    bad = [f"`cfg['{key}']` = {value} is not divisible by {axis} = {size} ({why})"
           for value, key, axis, size, why in rules if value % size]
    if bad:
        raise wb.SpecError("the config does not fit the mesh: " + "; ".join(bad)
                        + "; choose dp and tp that divide these sizes")


def make_mesh(dp: int = 2, tp: int = 2) -> Mesh:
    """A ``(dp, tp)`` mesh over the first ``dp * tp`` devices, axis names ``("dp", "tp")``.

    Args:
        dp: data-parallel (FSDP) axis size, >= 1.
        tp: tensor-parallel axis size, >= 1.

    Returns:
        A :class:`jax.sharding.Mesh` with devices ``jax.devices()[:dp * tp]`` in row-major order.

    Raises:
        ValueError: dp or tp is below 1, or JAX sees fewer than ``dp * tp`` devices.

    Examples:
        >>> dict(make_mesh(dp=1, tp=1).shape)
        {'dp': 1, 'tp': 1}
    """
    if dp < 1 or tp < 1:
        raise ValueError(f"make_mesh(dp={dp}, tp={tp}): both axis sizes must be >= 1")
    n = dp * tp
    devices = jax.devices()
    if len(devices) < n:
        raise ValueError(
            f"make_mesh(dp={dp}, tp={tp}) needs {n} devices but JAX sees {len(devices)} "
            f"({devices[0].platform}); for emulated CPU devices call "
            f"jax.config.update('jax_num_cpu_devices', {n}) right after `import jax`, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}, before JAX initialises its "
            f"backend (the first jax.devices() call or array operation)")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(dp, tp), ("dp", "tp"))


def _mesh_axes(mesh: Mesh | None) -> tuple[int, int]:
    if mesh is None:
        return 1, 1
    shape = dict(mesh.shape)
    if set(shape) != {"dp", "tp"}:
        raise wb.SpecError(
            f"`mesh` has axes {tuple(shape)}; the JAX reference layout shards over axes named "
            f"('dp', 'tp'), so build the mesh with make_mesh(dp, tp)")
    return shape["dp"], shape["tp"]


def make_load_fn(cfg: Mapping = TINY, mesh: Mesh | None = None, *,
                 tp_shard: tuple[int, int] | None = None,
                 fp8: Any = None) -> Callable[[Mapping[str, Any]], dict]:
    """The reference JAX trainer's ``load``: full HF checkpoint tensors -> sharded params pytree.

    ``load`` only moves data (transposes, reshapes, stacks, zero padding with ``jax.numpy``) and
    keeps each input's dtype; it is not jitted. The layout is in this module's docstring.

    Args:
        cfg: a qwen3_moe architecture config (see :func:`wb.layouts.presets.spec_from_config`).
        mesh: a mesh with axes ``("dp", "tp")`` (see :func:`make_mesh`); each leaf is placed with
            ``jax.device_put(x, NamedSharding(mesh, spec))``. ``None``: plain single-device arrays,
            laid out as for ``tp = 1``.
        tp_shard: ``(rank, tp)`` instead of a mesh: each leaf is what device ``rank`` of a
            ``(dp=1, tp)`` mesh holds, as a plain array (one device's load, on a machine with
            fewer devices); :func:`expected_maps` with ``tp_rank`` is its oracle.
        fp8: a :class:`wb.FP8Blocks` of every ``*_proj.weight`` tensor: ``load`` takes that FP8
            checkpoint (``fp8.bind(spec_from_config(cfg)).spec``): the projection kernels come
            in float8_e4m3fn (laid out as above), and the params gain ``scales``, ``{scale
            tensor name: its float32 array}``, replicated.

    Returns:
        ``load(ckpt)``, where ``ckpt`` maps every tensor name of ``spec_from_config(cfg)`` to its
        full array (numpy, ml_dtypes bfloat16, or ``jax.Array``); it returns the params pytree of
        nested dicts and lists of ``jax.Array``.

    Raises:
        wb.SpecError: (a ValueError) the architecture is not qwen3_moe, a config field is missing, or
            dp/tp do not divide a sharded dimension (every such clash is listed). ``load`` raises
            it when ``ckpt`` lacks a tensor, has an unknown one, a tensor has the wrong shape, or
            JAX would change its dtype (float64/int64 without ``jax_enable_x64``).

    Examples:
        >>> load = make_load_fn(TINY)
        >>> params = load(checkpoint_arrays(spec_from_config(TINY)))
        >>> params["embed"].shape, params["embed"].dtype
        ((104, 32), dtype(bfloat16))
        >>> params["layers"][1]["mlp"]["gate_up"].shape  # [2, E, h, mi]
        (2, 4, 32, 16)
    """
    d = _dims(cfg)
    dp, tp = _mesh_axes(mesh)
    if tp_shard is not None:
        if mesh is not None or not 0 <= tp_shard[0] < tp_shard[1]:
            raise wb.SpecError(f"tp_shard={tp_shard} needs mesh=None and 0 <= rank < tp")
        tp = tp_shard[1]
    _check_fits(d, dp, tp)
    spec = spec_from_config(cfg)
    scale_names: list[str] = []
    if fp8 is not None:
        scaled = fp8.bind(spec)
        proj = {n for n in spec.names if n.endswith("_proj.weight")}
        if set(scaled.names) != proj:
            raise wb.SpecError(f"the reference JAX load serves FP8 for every projection weight (the "
                            f"*_proj.weight tensors) and nothing else; the declaration covers "
                            f"{len(scaled.names)} tensors, not those {len(proj)}")
        spec = scaled.spec
        scale_names = [scaled.scale_name(t) for t in range(len(scaled.names))]
    vp = d.padded_vocab(VOCAB_MULTIPLE * tp)
    # kv heads are few; when tp does not divide them, trainers replicate k and v rather than pad.
    kv_spec = P(None, "tp", None) if d.kv_heads % tp == 0 else P()

    def put(x: jax.Array, pspec: P) -> jax.Array:
        if tp_shard is not None and "tp" in tuple(pspec):
            axis, (r, n) = tuple(pspec).index("tp"), tp_shard
            k = x.shape[axis] // n
            return jax.lax.slice_in_dim(x, r * k, (r + 1) * k, axis=axis)
        return x if mesh is None else jax.device_put(x, NamedSharding(mesh, pspec))

    def load(ckpt: Mapping[str, Any]) -> dict:
        unknown = [n for n in ckpt if n not in spec]
        if unknown:
            raise wb.SpecError(
                f"`ckpt` has tensors the config does not define: {unknown[:3]}"
                f"{' ...' if len(unknown) > 3 else ''}; pass exactly the tensors of "
                f"spec_from_config(cfg) (is tie_word_embeddings right?)")

        def take(name: str) -> jax.Array:
            if name not in ckpt:
                raise wb.SpecError(f"`ckpt` has no tensor `{name}`; load needs all {len(spec)} "
                                f"tensors of spec_from_config(cfg)")
            x = ckpt[name]
            if tuple(x.shape) != spec.shape(name):
                raise wb.SpecError(f"`ckpt['{name}']` has shape {tuple(x.shape)}, the config says "
                                f"{spec.shape(name)}")
            y = jnp.asarray(x)
            if y.dtype != x.dtype:
                raise wb.SpecError(
                    f"`ckpt['{name}']` is {np.dtype(x.dtype).name} but JAX would store it as "
                    f"{y.dtype.name}; load never casts, so pass {y.dtype.name} or enable "
                    f"jax_enable_x64")
            return y

        def pad_vocab(w: jax.Array) -> jax.Array:  # [V, h] -> [Vp, h], zero rows
            return jnp.pad(w, ((0, vp - d.vocab), (0, 0)))

        h, hd = d.hidden, d.head_dim
        params: dict = {"embed": put(pad_vocab(take("model.embed_tokens.weight")), P("tp", None))}
        layers = []
        for i in range(d.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            attn = {
                "q": put(take(a + "q_proj.weight").T.reshape(h, d.heads, hd), P("dp", "tp", None)),
                "k": put(take(a + "k_proj.weight").T.reshape(h, d.kv_heads, hd), kv_spec),
                "v": put(take(a + "v_proj.weight").T.reshape(h, d.kv_heads, hd), kv_spec),
                "o": put(take(a + "o_proj.weight").T.reshape(d.heads, hd, h), P("tp", None, "dp")),
                "q_norm": put(take(a + "q_norm.weight"), P()),
                "k_norm": put(take(a + "k_norm.weight"), P()),
            }
            m = p + "mlp."
            if i < d.n_dense:
                gate_up = jnp.stack([take(m + "gate_proj.weight").T, take(m + "up_proj.weight").T])
                mlp = {"gate_up": put(gate_up, P(None, "dp", "tp")),
                       "down": put(take(m + "down_proj.weight").T, P("tp", None))}
            else:
                ex = [f"{m}experts.{e}." for e in range(d.experts)]
                gate = jnp.stack([take(x + "gate_proj.weight").T for x in ex])  # [E, h, mi]
                up = jnp.stack([take(x + "up_proj.weight").T for x in ex])
                down = jnp.stack([take(x + "down_proj.weight").T for x in ex])  # [E, mi, h]
                mlp = {"router": put(take(m + "gate.weight").T, P()),
                       "gate_up": put(jnp.stack([gate, up]), P(None, "tp", None, None)),
                       "down": put(down, P("tp", "dp", None))}
            layers.append({
                "input_norm": put(take(p + "input_layernorm.weight"), P()),
                "post_norm": put(take(p + "post_attention_layernorm.weight"), P()),
                "attn": attn, "mlp": mlp})
        params["layers"] = layers
        params["final_norm"] = put(take("model.norm.weight"), P())
        if not d.tied:
            params["lm_head"] = put(pad_vocab(take("lm_head.weight")).T, P(None, "tp"))
        if scale_names:  # the FP8 checkpoint's block scales, as they are, on every device
            params["scales"] = {n: put(take(n), P()) for n in scale_names}
        return params

    return load


def expected_maps(cfg: Mapping = TINY, tp: int = 1, *, tp_rank: int | None = None,
                  as_maps: bool = False) -> dict[str, np.ndarray] | dict[str, wb.SourceMap]:
    """The oracle: which global checkpoint id each element of each params leaf holds.

    Computed with numpy only and written independently of :func:`make_load_fn` (each transform
    takes a different but equivalent route, e.g. reshape-then-transpose where ``load`` transposes
    first), so the two agreeing is evidence that both follow the documented layout.

    Args:
        cfg: a qwen3_moe architecture config.
        tp: the mesh's tp size; it only sets the padded vocabulary ``Vp`` (``None`` mesh: 1).
        tp_rank: only what device ``tp_rank`` of a ``(dp=1, tp)`` mesh holds (the oracle of
            ``make_load_fn(cfg, tp_shard=(tp_rank, tp))``).
        as_maps: return :class:`wb.SourceMap` values, each built from its ids and dropped before
            the next leaf's (for dimensions whose int64 ids would not fit in memory at once).

    Returns:
        ``{jax.tree_util.keystr(path): ids}`` for every leaf of the params pytree, e.g.
        ``"['layers'][0]['attn']['q']"``; ``ids`` is an int64 array of the leaf's global shape,
        -1 where the leaf holds padding (zeros). With ``as_maps``, SourceMaps of those ids.

    Raises:
        wb.SpecError: (a ValueError) tp < 1, the architecture is not qwen3_moe, or a field is missing.

    Examples:
        >>> maps = expected_maps(TINY, tp=2)
        >>> maps["['embed']"].shape, int(maps["['embed']"][-1, 0]), int(maps["['embed']"][0, 1])
        ((112, 32), -1, 1)
    """
    if tp < 1:
        raise wb.SpecError(f"expected_maps(tp={tp}): tp must be >= 1")
    d = _dims(cfg)
    spec = spec_from_config(cfg)
    vp = d.padded_vocab(VOCAB_MULTIPLE * tp)
    h, nh, kv, hd = d.hidden, d.heads, d.kv_heads, d.head_dim

    # the vocabulary rows built: a TP rank's own only (embed and lm_head split them over "tp")
    rows = range(vp) if tp_rank is None else range(tp_rank * vp // tp, (tp_rank + 1) * vp // tp)

    def padded_rows(name: str) -> np.ndarray:
        out = np.full((len(rows), h), -1, dtype=np.int64)
        real = range(rows.start, min(rows.stop, d.vocab))
        if len(real):
            out[: len(real)] = (spec.offset(name) + np.arange(real.start * h, real.stop * h,
                                                               dtype=np.int64)).reshape(-1, h)
        return out

    def heads_in(ids: np.ndarray, n: int) -> np.ndarray:
        # [n*hd, h] (row n_*hd + d_ is head n_, dim d_) -> [h, n, hd]
        return ids.reshape(n, hd, h).transpose(2, 0, 1)

    # the experts whose ids are built: a TP rank's own only (the MoE leaves split the experts
    # over "tp"), so a rank's oracle never holds every expert's ids at once
    experts = range(d.experts)
    if tp_rank is not None:
        k = d.experts // tp
        experts = range(tp_rank * k, (tp_rank + 1) * k)

    def leaves(i: int) -> dict[str, Callable[[], np.ndarray]]:
        """Layer ``i``'s leaves: ``{key: a function giving its ids}`` (built when asked)."""
        key, p = f"['layers'][{i}]", f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        ids = spec.ids
        out = {
            f"{key}['input_norm']": lambda: ids(p + "input_layernorm.weight"),
            f"{key}['post_norm']": lambda: ids(p + "post_attention_layernorm.weight"),
            f"{key}['attn']['q']": lambda: heads_in(ids(a + "q_proj.weight"), nh),
            f"{key}['attn']['k']": lambda: heads_in(ids(a + "k_proj.weight"), kv),
            f"{key}['attn']['v']": lambda: heads_in(ids(a + "v_proj.weight"), kv),
            # o_proj [h, nh*hd] (column n_*hd + d_) -> [nh, hd, h]
            f"{key}['attn']['o']": lambda: ids(a + "o_proj.weight").reshape(
                h, nh, hd).transpose(1, 2, 0),
            f"{key}['attn']['q_norm']": lambda: ids(a + "q_norm.weight"),
            f"{key}['attn']['k_norm']": lambda: ids(a + "k_norm.weight"),
        }
        if i < d.n_dense:
            out[f"{key}['mlp']['gate_up']"] = lambda: np.stack(
                [np.swapaxes(ids(m + f"{w}_proj.weight"), 0, 1) for w in ("gate", "up")])
            out[f"{key}['mlp']['down']"] = lambda: np.swapaxes(ids(m + "down_proj.weight"), 0, 1)
        else:
            out[f"{key}['mlp']['router']"] = lambda: np.swapaxes(ids(m + "gate.weight"), 0, 1)
            # [2, E, mi, h] of PyTorch weights, then [in, out] kernels by swapping the last axes
            out[f"{key}['mlp']['gate_up']"] = lambda: np.swapaxes(np.array(
                [[ids(m + f"experts.{e}.{w}_proj.weight") for e in experts]
                 for w in ("gate", "up")]), -1, -2)
            out[f"{key}['mlp']['down']"] = lambda: np.swapaxes(np.array(
                [ids(m + f"experts.{e}.down_proj.weight") for e in experts]), -1, -2)
        return out

    todo: dict[str, Callable[[], np.ndarray]] = {
        "['embed']": lambda: padded_rows("model.embed_tokens.weight")}
    for i in range(d.layers):
        todo.update(leaves(i))
    todo["['final_norm']"] = lambda: spec.ids("model.norm.weight")
    if not d.tied:
        todo["['lm_head']"] = lambda: padded_rows("lm_head.weight").T
    if tp_rank is not None:
        # the axis each leaf is split along over "tp" (the module docstring's PartitionSpecs)
        axis = {"['embed']": 0, "['q']": 1, "['k']": 1 if kv % tp == 0 else None,
                "['v']": 1 if kv % tp == 0 else None, "['o']": 0, "['router']": None,
                "['gate_up']": 1, "['down']": 0, "['lm_head']": 1}
        dense = {f"['layers'][{i}]['mlp']" for i in range(d.n_dense)}

        def shard(key: str, f: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
            leaf = key[key.rfind("["):]
            ax = axis.get(leaf)
            if key[:key.rfind("[")] in dense:  # dense MLP: gate_up (None, dp, tp), down (tp, None)
                ax = {"['gate_up']": 2, "['down']": 0}[leaf]
            elif leaf in ("['gate_up']", "['down']", "['embed']", "['lm_head']"):
                ax = None  # MoE experts and vocabulary rows: built with the rank's own only
            if ax is None:
                return f

            def part() -> np.ndarray:
                ids = f()
                k = ids.shape[ax] // tp
                return np.take(ids, np.arange(tp_rank * k, (tp_rank + 1) * k), axis=ax)
            return part
        todo = {k: shard(k, f) for k, f in todo.items()}
    if as_maps:
        return {k: wb.SourceMap.from_indices(f()) for k, f in todo.items()}
    return {k: np.ascontiguousarray(f(), dtype=np.int64) for k, f in todo.items()}


def checkpoint_arrays(spec: wb.CheckpointSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random full checkpoint tensors in the spec's dtypes (bfloat16 as ``ml_dtypes.bfloat16``).

    Floats are standard normal rounded to the dtype; integers are uniform in ``[-128, 127]`` clipped
    to the dtype's range (so no cast overflows); bools are fair coin flips.

    Args:
        spec: the checkpoint spec, e.g. ``spec_from_config(TINY)``.
        seed: seed of ``numpy.random.default_rng``; equal seeds give equal arrays.

    Returns:
        ``{name: array}`` in spec order, each of the spec's shape and dtype.

    Examples:
        >>> arrays = checkpoint_arrays(spec_from_config(TINY))
        >>> arrays["lm_head.weight"].shape, arrays["lm_head.weight"].dtype
        ((100, 32), dtype(bfloat16))
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name in spec.names:
        dt, shape = dtype_info(spec.dtype(name)).numpy, spec.shape(name)
        if dt == np.bool_:
            out[name] = rng.random(shape) < 0.5
        elif np.issubdtype(dt, np.integer):
            info = np.iinfo(dt)
            out[name] = rng.integers(max(info.min, -128), min(info.max, 127), size=shape,
                                     endpoint=True).astype(dt)
        else:
            out[name] = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    return out


def sparse_train_step(params: Any, step: int) -> Any:
    """:func:`wb.testing.versions.sparse_step` on every leaf, as a new pytree with the same
    shardings: about one element in :data:`~wb.testing.versions.SPARSE_EVERY` changes (what
    ``python -m wb demo --delta`` trains with)."""
    from wb.testing import SPARSE_EVERY

    ints = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
    mask = SPARSE_EVERY - 1

    def one(x):
        b = jax.lax.bitcast_convert_type(x, ints[x.dtype.itemsize])
        pick = ((b ^ (b >> 7)) & mask) == (step & mask)
        return jnp.where(pick, x * jnp.asarray(-2.0, x.dtype), x)
    return jax.tree.map(one, params)


@functools.partial(jax.jit, static_argnames="factor")
def train_step(params: Any, factor: float = -2.0) -> Any:
    """The reference trainer's update, as a new pytree with the same shardings:
    ``w <- factor * w`` (exact in any float dtype for a power of two)."""
    return jax.tree.map(lambda x: x * jnp.asarray(factor, x.dtype), params)
