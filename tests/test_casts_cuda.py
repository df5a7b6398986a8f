"""Conversions on CUDA buffers: the CuPy kernels of wb.runtime.engine.casts equal the host conversion
(itself torch.Tensor.to, tests/test_casts.py) bit for bit, strided views included, and a plan
that converts runs bit-identical with every buffer on the GPU. Skips cleanly without a GPU."""

import numpy as np
import pytest

from harness.cuda import cupy_or_skip

cupy = cupy_or_skip()

import wb  # noqa: E402
from wb.data.dtypes import FLOATS, convert, dtype_info  # noqa: E402
from wb.runtime.engine.casts import assign, xp_dtype  # noqa: E402

from test_casts import _values, converting_deployment  # noqa: E402


@pytest.mark.parametrize("src", sorted(FLOATS))
def test_cuda_kernels_equal_the_host_conversion(src):
    x = _values(src, n=50000)
    if src in ("float8_e4m3fn", "float8_e5m2"):  # every bit pattern of a byte
        x = np.arange(256, dtype=np.uint8).view(dtype_info(src).numpy)
    raw = x.view(f"u{x.itemsize}")
    dx = cupy.asarray(raw).view(xp_dtype(cupy, src))
    for dst in sorted(FLOATS):
        info = dtype_info(dst)
        want = np.empty(x.shape, info.numpy)
        convert(want, x)
        out = cupy.zeros(x.shape, xp_dtype(cupy, dst))
        assign(cupy, out, dx, dst, src)
        got = cupy.asnumpy(out).view(f"u{info.itemsize}")
        nan = np.isnan(x.astype(np.float64))
        assert np.isnan(got[nan].view(info.numpy).astype(np.float64)).all()
        bad = np.flatnonzero((got != want.view(f"u{info.itemsize}")) & ~nan)
        assert bad.size == 0, (src, dst, x[bad[:5]], got[bad[:5]], want.view(f"u{info.itemsize}")[bad[:5]])
        # strided views on both sides (the executor converts buffer regions in place)
        m = (x.size // 12) * 12
        sv = dx[:m].reshape(-1, 12)[:, ::3]
        ov = cupy.zeros((m // 12, 12), xp_dtype(cupy, dst))[:, 1::3]
        assign(cupy, ov, sv, dst, src)
        w = want[:m].reshape(-1, 12)[:, ::3].view(f"u{info.itemsize}")
        g = cupy.asnumpy(ov).view(f"u{info.itemsize}")
        assert (g == w)[~nan[:m].reshape(-1, 12)[:, ::3]].all()


@pytest.mark.timeout(300)
def test_converting_plan_with_cuda_buffers_is_bit_identical(tmp_path):
    pytest.importorskip("ucxx")
    from harness.multiproc import run_ranks

    p = wb.plan(*converting_deployment(), chunk_bytes=2048)
    p.save(tmp_path / "plan.npz")
    run = run_ranks(str(tmp_path / "plan.npz"), list(range(6)), str(tmp_path / "run"),
                    options={"timeout": 60, "held": "bfloat16", "cuda_device": 0})
    assert all(run.results[r] and run.results[r]["ok"] for r in range(6)), run.results
    assert all(run.results[r]["bit_identical"] for r in range(2, 6))
