"""Block-scaled FP8 on CUDA buffers: the CuPy quantiser of wb.runtime.engine.fp8 equals the host one
(itself the plain reference, tests/test_fp8.py) bit for bit, on values that stress the rule, and
an FP8 plan runs bit-identical with every buffer on the GPU. Skips cleanly without a GPU."""

import numpy as np
import pytest

from harness.cuda import cupy_or_skip

cupy = cupy_or_skip()

import wb  # noqa: E402
from harness.fp8 import lay  # noqa: E402
from wb.algorithms.fp8.tasks import (combine_amax, quantize_all, quantize_buffers,  # noqa: E402
                                      quantize_layouts)
from wb.data.fp8 import FP8Blocks  # noqa: E402
from wb.data.dtypes import convert, dtype_info  # noqa: E402
from wb.runtime.engine.casts import xp_dtype  # noqa: E402
from wb.runtime.engine.fp8 import Quantiser  # noqa: E402


def _on_gpu(a: np.ndarray, dtype: str):
    return cupy.asarray(a.view(f"u{a.itemsize}")).view(xp_dtype(cupy, dtype))


def _hard(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    parts = [rng.standard_normal(n) * np.exp2(rng.integers(-140, 30, n)),  # wide spread
             rng.standard_normal(n) * 2.0**-135,  # subnormal scales (or 0)
             np.where(rng.random(n) < 0.7, 0.0, rng.standard_normal(n)),
             rng.integers(-896, 897, n) / 2.0]  # amax 448: e4m3 ties
    x = parts[seed % 4]
    a = np.empty(shape, dtype_info(dtype).numpy)
    with np.errstate(all="ignore"):
        convert(a, x.reshape(shape))
    return a


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shape", [(300, 260), (296, 256)])  # lines of 16-byte multiples or not
@pytest.mark.parametrize("transposed", [True, False])
def test_cuda_quantiser_equals_the_host_one(dtype, seed, shape, transposed):
    spec = wb.CheckpointSpec({"w": (shape, dtype)})
    sc = FP8Blocks(("w",), block=(128, 64)).bind(spec)
    ids = spec.ids("w").reshape(shape)
    trainers = [lay(0, "t", "trainer", {"w": (ids.T if transposed else ids, dtype)})]
    q = quantize_layouts(trainers, sc)
    x = _hard(shape, dtype, seed)
    x = np.ascontiguousarray(x.T) if transposed else x
    host = quantize_buffers(q, 0, {"w": x})
    live = {"w": (cupy, _on_gpu(x, dtype))}
    qz = Quantiser(q, 0, live)
    qz.run(live)
    for k, h in host.items():
        got = cupy.asnumpy(qz.buffers[k]).view(f"u{h.itemsize}")
        assert got.tobytes() == h.view(f"u{h.itemsize}").tobytes(), k


_ENC_CHECK = r"""
extern "C" __global__ void wb_enc_check(unsigned long long* bad, unsigned int* first) {
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long u = blockIdx.x * blockDim.x + threadIdx.x;
    for (; u < (1ull << 32); u += step) {
        float f = __uint_as_float((unsigned int)u);
        if (wb_enc_e4m3(f) != wb_enc_f(f, 4, 3, true)) {
            atomicAdd(bad, 1ull);
            atomicMin(first, (unsigned int)u);
        }
    }
}
"""


def test_the_devices_e4m3_encoder_rounds_every_float32_as_the_rule():
    """The quantiser's hardware conversion to float8_e4m3fn (one instruction on GPUs that have
    it) gives the bits of its integer encoder (``wb_enc_f``, checked against the casts' one on
    the host: tests/test_quant_kernel_host.py) for every one of the 2**32 float32 values."""
    from wb.runtime.engine.quant_kernel import kernel_source

    k = cupy.RawKernel(kernel_source("float32", "float8_e4m3fn") + _ENC_CHECK, "wb_enc_check")
    bad, first = cupy.zeros(1, cupy.uint64), cupy.full(1, 0xffffffff, cupy.uint32)
    k((1024,), (256,), (bad, first))
    assert int(bad[0]) == 0, f"{int(bad[0])} float32 values differ, the first {int(first[0]):#010x}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("seed", range(4))
def test_cuda_quantiser_of_blocks_held_in_parts_equals_the_host_one(dtype, seed):
    # blocks of 128 rows; rows 0-149 on rank 0 (transposed), the rest in two flat runs cut at
    # element 200 * 260 + 7 (ranks 1, 2): block row 1 is split between all three, affinely on
    # rank 0, element by element on the others
    spec = wb.CheckpointSpec({"w": ((300, 260), dtype)})
    sc = FP8Blocks(("w",), block=(128, 64)).bind(spec)
    ids = spec.ids("w").reshape(300, 260)
    cut = 200 * 260 + 7
    trainers = [lay(0, "t", "trainer", {"w": (ids[:150].T, dtype)}),
                lay(1, "t", "trainer", {"w": (ids.reshape(-1)[150 * 260:cut], dtype)},
                    local_rank=1),
                lay(2, "u", "trainer", {"w": (ids.reshape(-1)[cut:], dtype)})]
    q = quantize_layouts(trainers, sc)
    x = _hard((300, 260), dtype, seed)
    own = {0: {"w": np.ascontiguousarray(x[:150].T)}, 1: {"w": x.reshape(-1)[150 * 260:cut].copy()},
           2: {"w": x.reshape(-1)[cut:].copy()}}
    host = quantize_all(q, own)
    live = {r: {"w": (cupy, _on_gpu(own[r]["w"], dtype))} for r in own}
    qz = {r: Quantiser(q, r, live[r]) for r in own}
    assert all(z.parts for z in qz.values())
    mine = {r: z._partial_amax(live[r]) for r, z in qz.items()}
    whole = combine_amax(mine.values())
    for r, z in qz.items():
        z.run(live[r], exchange=lambda keys, amax: whole)
        for k, h in host[r].items():
            got = cupy.asnumpy(z.buffers[k]).view(f"u{h.itemsize}")
            assert got.tobytes() == h.view(f"u{h.itemsize}").tobytes(), (r, k)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_over_ucx_with_every_buffer_on_the_gpu_is_bit_identical(tmp_path, split):
    pytest.importorskip("ucxx")
    from test_fp8 import run_fp8_over_ucx

    run_fp8_over_ucx(tmp_path, {"versions": 2, "sender_staging": True, "receiver_staging": False,
                                "cuda": 0, "split": split})
