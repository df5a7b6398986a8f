"""The public API: `wb.__all__` is a deliberate list, each name in it is documented, and the calls
of DESIGN.md section 8 (which tests outside this repository make) work as written there."""

import inspect
import re
from dataclasses import is_dataclass
from enum import Enum
from types import ModuleType

import numpy as np

import wb
from wb.data.dtypes import dtype_info

# The deliberate public surface: what a user calls, about 35 names (internals stay importable from
# their modules). Adding a name is a decision: add it here too, and to the CHANGELOG.
PUBLIC = {
    # data
    "CheckpointSpec", "SourceMap", "Worker", "BufferSpec", "Layout", "Cluster", "Plan",
    "RankPlan", "Traffic", "FP8Blocks",
    # algorithms
    "probe", "plan", "lower_bound", "simulate", "run_local",
    # runtime: transport
    "Transport", "Request", "UcxTransport", "Store", "MemoryStore", "DirectoryStore",
    "TorchStore", "JaxStore", "RayStore", "KeyedStore",
    # runtime: membership and endpoints
    "agree_parts", "Sender", "Receiver", "SenderGroup", "ReceiverGroup", "ParamsAdapter",
    "LocalSession", "MODES", "summarize",
    # errors
    "WbError", "SpecError", "ProbeError", "PlanError", "TransferError", "PeersLost",
    "ChecksumError", "AuthError",  # a refused version (caught at apply), a refused stranger
}
MAX_PUBLIC = 42  # 40 until the job key and the checksums (0.2.0)


def test_all_is_the_deliberate_public_list():
    assert len(wb.__all__) == len(set(wb.__all__)), "a name is listed twice in wb.__all__"
    assert len(wb.__all__) <= MAX_PUBLIC, (f"wb.__all__ has {len(wb.__all__)} names: a user should "
                                           f"hold the API in their head (<= {MAX_PUBLIC})")
    added, dropped = sorted(set(wb.__all__) - PUBLIC), sorted(PUBLIC - set(wb.__all__))
    assert not added and not dropped, (f"wb.__all__ adds {added} and drops {dropped}; if that is "
                                       f"deliberate, say so in PUBLIC above (and the changelog)")
    for name in wb.__all__:
        assert getattr(wb, name, None) is not None, f"wb.__all__ lists {name!r}; wb has none"
    # nothing public slips in beside __all__ (subpackages such as wb.data are attributes too)
    stray = {n for n, v in vars(wb).items()
             if not n.startswith("_") and not isinstance(v, ModuleType)} - PUBLIC
    assert not stray, f"public names in wb missing from wb.__all__ (or make them private): {stray}"


def _commented_fields(cls) -> set[str]:
    """Fields of a NamedTuple or dataclass documented by a trailing comment (`n: int  # why`)."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):
        return set()
    return {m.group(1) for line in lines
            if (m := re.match(r"\s+(\w+)\s*:[^#]*#\s*\S", line))}


def _missing_docs(name: str, obj) -> list[str]:
    """What the Google-style docstring of a public function or class lacks."""
    if isinstance(obj, ModuleType):
        return [] if obj.__doc__ else [f"{name}: no docstring"]
    # a class's own docstring: not a base class's, nor the signature namedtuple/dataclass write
    doc = (vars(obj).get("__doc__") if inspect.isclass(obj) else inspect.getdoc(obj)) or ""
    if not doc.strip() or (inspect.isclass(obj) and doc.startswith(f"{obj.__name__}(")):
        return [f"{name}: no docstring"]
    if inspect.isclass(obj):
        if issubclass(obj, (BaseException, Enum)) or getattr(obj, "_is_protocol", False):
            return []  # raised, looked up or implemented, not built by a user from arguments
        params = list(inspect.signature(obj).parameters)
        init_doc = inspect.getdoc(vars(obj).get("__init__")) or ""
        if not params or any(s in doc + init_doc for s in ("Args:", "Attributes:")):
            return []
        if not (hasattr(obj, "_fields") or is_dataclass(obj)):
            return [f"{name}: takes {params} but its docstring has no Args:"]
        uncommented = [p for p in params if p not in _commented_fields(obj)]
        if uncommented:  # pure data may say what each field is in a trailing comment instead
            return [f"{name}: no Attributes: in its docstring, and fields {uncommented} have no "
                    f"trailing comment"]
        return []
    if not callable(obj):
        return []
    sig, out = inspect.signature(obj), []
    if sig.parameters and "Args:" not in doc:
        out.append(f"{name}: takes {list(sig.parameters)} but its docstring has no Args:")
    if sig.return_annotation not in (None, "None") and not any(
            s in doc for s in ("Returns:", "Yields:")):
        out.append(f"{name}: returns a value but its docstring has no Returns:")
    return out


def test_every_public_name_is_documented():
    """Every function and class in `wb.__all__` has a docstring; functions say Args: and
    Returns:, classes that take arguments say Args: (STYLE.md)."""
    missing = [m for name in sorted(wb.__all__) for m in _missing_docs(name, getattr(wb, name))]
    assert not missing, "public names with incomplete docstrings:\n" + "\n".join(missing)


def test_the_docstring_check_is_not_vacuous():
    def documented(a, *, b=1) -> int:
        """Does a thing.

        Args:
            a: one.
            b: two.

        Returns:
            three.
        """

    def bare(a) -> int:
        """Does a thing."""

    assert _missing_docs("documented", documented) == []
    assert len(_missing_docs("bare", bare)) == 2
    assert _missing_docs("undocumented", lambda: None) == ["undocumented: no docstring"]


def test_design_section_8_calls():
    """Each call of DESIGN.md section 8, on a 4 x 8 bf16 tensor split into column halves."""
    spec = wb.CheckpointSpec({"w": ((4, 8), "bfloat16"), "b": ((8,), "float32")})
    assert (spec.offset("b"), spec.numel, spec.nbytes) == (32, 40, 4 * 8 * 2 + 8 * 4)
    ids = np.arange(32).reshape(4, 8)[:, 4:]
    sm = wb.SourceMap.from_indices(ids)
    assert sm.shape == (4, 4) and 0 < sm.nnz <= 16
    np.testing.assert_array_equal(sm.to_indices(), ids)
    maps = wb.probe(spec, lambda ck: {"right": np.asarray(ck["w"])[:, 4:]})
    np.testing.assert_array_equal(maps["right"].to_indices(), ids)
    assert issubclass(wb.ProbeError, wb.WbError) and issubclass(wb.PlanError, wb.WbError)
    assert issubclass(wb.TransferError, wb.WbError)

    def lay(rank, node, role, cols):
        sub = wb.SourceMap.from_indices(np.arange(32).reshape(4, 8)[:, cols])
        return wb.Layout(wb.Worker(rank=rank, node=node, role=role, local_rank=0),
                         {"w": wb.BufferSpec(sub, "bfloat16")})

    trainers = [lay(0, "t0", "trainer", slice(0, 4)), lay(1, "t1", "trainer", slice(4, 8))]
    rollouts = [lay(2, "r0", "rollout", slice(0, 8))]
    plan = wb.plan(trainers, rollouts, cluster=None)
    plan.verify()
    traffic, bound = plan.traffic(), wb.lower_bound(trainers, rollouts)
    assert isinstance(traffic, wb.Traffic) and isinstance(bound, wb.Traffic)
    assert bound.trainer_out == {0: 32, 1: 32} and bound.node_in == {"r0": 64}  # M = M_v = 64 B
    assert traffic.trainer_out == bound.trainer_out and traffic.node_in == bound.node_in
    bf16 = dtype_info("bfloat16").numpy
    full = np.arange(32, dtype=np.float32).reshape(4, 8).astype(bf16)
    out = wb.run_local(plan, {0: {"w": full[:, :4].copy()}, 1: {"w": full[:, 4:].copy()}},
                       {2: {"w": np.zeros((4, 8), bf16)}})
    assert out[2]["w"].tobytes() == full.tobytes()
    sim = wb.simulate(plan, wb.Cluster())
    assert 0 < sim.ideal_s <= sim.ewtt_s
