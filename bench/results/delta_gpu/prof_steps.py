import time, numpy as np, cupy as cp
from wb.algorithms import delta as codec
from wb.runtime.engine.deltas import device as dev
n=(128<<20)//2
rng=np.random.default_rng(0); bh=rng.integers(0,1<<16,n,dtype=np.uint16); nh=bh.copy(); nh[rng.random(n)<0.0424]^=1
b=cp.asarray(bh).view(cp.uint8); v=cp.asarray(nh).view(cp.uint8)
def t(f, r=20):
    f(); cp.cuda.Device().synchronize(); best=1e9
    for _ in range(r):
        t0=time.perf_counter(); f(); cp.cuda.Device().synchronize(); best=min(best,time.perf_counter()-t0)
    return round(best*1e3,3)
x=cp.zeros(8,cp.uint8)
print("sync D2H 8B", t(lambda: x.get()))
print("H2D 8KB", t(lambda: cp.asarray(np.zeros(1024,np.int64))))
count, compact = dev._kernels(2)
nb=-(-n//codec.BLOCK); counts=cp.empty(nb,cp.uint32)
bb, vv = b.view(cp.uint16), v.view(cp.uint16)
print("count kernel", t(lambda: count((nb,),(1024,),(bb,vv,np.int64(n),counts))))
host=counts.get(); k=int(host.sum()); starts=cp.asarray(np.concatenate([[0],np.cumsum(host)[:-1]]).astype(np.int64))
vals=cp.empty(k,cp.uint16); pl=cp.empty(k,cp.uint16)
print("compact kernel", t(lambda: compact((nb,),(1024,),(bb,vv,np.int64(n),starts,vals,pl,np.int32(0)))))
print("encode", t(lambda: dev.encode(b, v, itemsize=2, xp=cp)))
d=dev.encode(b, v, itemsize=2, xp=cp); tgt=b.copy()
print("apply", t(lambda: dev.apply(tgt, d, xp=cp)))
print("get_function", t(lambda: dev._module().get_function("wb_delta_positions")))
print("copy", t(lambda: cp.copyto(tgt, b)))
