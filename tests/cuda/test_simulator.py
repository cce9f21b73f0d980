"""The CUDA simulator: real CUDA C++ kernels compiled for the host and driven through ``sim.driver`` exactly as
the provider drives ``cuda.bindings.driver`` (cuda-python's call and return conventions).

The kernels are compiled once per source and cached on disk, so re-runs skip the host compiler.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda.sim import compiler  # noqa: E402

OK = cu.CUresult.CUDA_SUCCESS

KERNELS = r"""
#ifndef TILE
#error TILE comes from the compile options
#endif

// Block-level sum: warp shuffles, one partial per warp in shared memory, and a tail that only warp 0 runs
// while the other warps have already returned.
extern "C" __global__ void __launch_bounds__(TILE) block_sum(const float* __restrict__ x, float* out, long long n) {
    __shared__ float partial[TILE / 32];
    float v = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        v += x[i];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x >= 32) return;
    v = threadIdx.x < blockDim.x / 32 ? partial[threadIdx.x] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (threadIdx.x == 0) atomicAdd(out, v);
}

// Inclusive scan of a 1,024-thread (32 x 8 x 4) block: ten double-buffered steps, a barrier after each.
extern "C" __global__ void block_scan(const int* x, int* y) {
    __shared__ int buf[2][1024];
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned size = blockDim.x * blockDim.y * blockDim.z;
    int src = 0;
    buf[0][t] = x[blockIdx.x * size + t];
    __syncthreads();
    for (unsigned offset = 1; offset < size; offset <<= 1) {
        int v = buf[src][t];
        if (t >= offset) v += buf[src][t - offset];
        buf[1 - src][t] = v;
        src = 1 - src;
        __syncthreads();
    }
    y[blockIdx.x * size + t] = buf[src][t];
}

extern __shared__ float tile[];  // dynamic shared memory declared at namespace scope

extern "C" __global__ void reverse_block(const float* x, float* y) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = x[i];
    __syncthreads();
    y[i] = tile[blockDim.x - 1 - threadIdx.x];
}

// Writes `count` bytes of dynamic shared memory, then reads them back reversed; out[count] = aligned?
extern "C" __global__ void shared_bytes(unsigned char* out, int count) {
    extern __shared__ __align__(sizeof(float4)) unsigned char raw[];
    for (int i = threadIdx.x; i < count; i += blockDim.x) raw[i] = (unsigned char)(i * 7);
    __syncthreads();
    for (int i = threadIdx.x; i < count; i += blockDim.x) out[i] = raw[count - 1 - i];
    if (threadIdx.x == 0) out[count] = ((unsigned long long)raw % 16) == 0;
}

extern "C" __global__ void histogram(const unsigned char* data, long long n, unsigned int* bins) {
    __shared__ unsigned int local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0;
    __syncthreads();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        atomicAdd(&local[data[i]], 1u);
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x)
        if (local[b]) atomicAdd(&bins[b], local[b]);
}

extern "C" __global__ void atomics(int* i32, unsigned long long* u64, float* f32, double* f64) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&u64[0], (unsigned long long)t);
    atomicMax(&i32[0], t);
    atomicMin(&i32[1], -t);
    atomicOr((unsigned int*)&i32[2], 1u << (t % 32));
    atomicAnd((unsigned int*)&i32[3], ~(1u << (t % 16)));
    int old = i32[4], assumed;
    do {  // the classic CAS loop
        assumed = old;
        old = atomicCAS(&i32[4], assumed, assumed + 3);
    } while (old != assumed);
    atomicExch(&i32[5], 7);
    atomicAdd(f32, 0.25f);
    atomicAdd(f64, 0.5);
}

extern "C" __global__ void convert(const float* x, unsigned short* h_bits, unsigned short* b_bits, float* h_back,
                                  float* b_back, long long n) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const __half h = __float2half(x[i]);
    const __nv_bfloat16 b = __float2bfloat16(x[i]);
    h_bits[i] = __half_as_ushort(h);
    b_bits[i] = __bfloat16_as_ushort(b);
    h_back[i] = __half2float(h);
    b_back[i] = __bfloat162float(b);
}

extern "C" __global__ void half_math(const __half* a, const __half* b, __half* out, const __nv_bfloat16* c,
                                    const __nv_bfloat16* d, __nv_bfloat16* bout, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[3 * i] = a[i] + b[i];
    out[3 * i + 1] = __hmul(a[i], b[i]);
    out[3 * i + 2] = a[i] < b[i] ? b[i] : a[i];
    bout[2 * i] = c[i] + d[i];
    bout[2 * i + 1] = c[i] * d[i];
}

extern "C" __global__ void early_exit(const float* x, float* y, int n) {
    __shared__ float s[256];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;  // threads past the end leave before the barrier
    s[threadIdx.x] = 2.0f * x[i];
    __syncthreads();
    const int last = min(blockDim.x, n - blockIdx.x * blockDim.x) - 1;
    y[i] = s[last - threadIdx.x];
}

// Launched with 48 threads: warp 1 has only 16 lanes. out has 8 ints per thread.
extern "C" __global__ void warp_ops(int* out) {
    const int t = threadIdx.x, lane = t & 31;
    int* o = out + 8 * t;
    o[0] = (int)__ballot_sync(0xffffffffu, t % 3 == 0);
    o[1] = __any_sync(0xffffffffu, t == 40);
    o[2] = __all_sync(0xffffffffu, t < 40);
    int sum = t;
    for (int m = 16; m; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    o[3] = sum;
    int scan = t;
    for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, scan, d);
        if (lane >= d) scan += v;
    }
    o[4] = scan;
    o[5] = __shfl_sync(0xffffffffu, t * 10, 3);
    o[6] = __shfl_down_sync(0xffffffffu, t, 1, 8);  // within segments of 8 lanes
    o[7] = __syncthreads_count(t % 2);
}

// Lane 0 waits at the block barrier while the rest of its warp waits for it in a shuffle.
extern "C" __global__ void deadlock(int* out) {
    if ((threadIdx.x & 31) == 0) __syncthreads();
    else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
}

extern "C" __global__ void write_index(int* out, long long count) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < count) out[i] = (int)i;
}

extern "C" __global__ void stack_hog(int* out, int index) {
    volatile int big[64 * 1024];  // 256 KiB of locals: more than a simulated thread's stack
    big[index] = index;
    out[threadIdx.x] = big[index];
}

extern "C" __global__ void trap_if(int flag) {
    if (flag == 1 && threadIdx.x == 5) __trap();
    assert(flag != 2 || threadIdx.x != 7);
}

extern "C" __global__ void axpb(const float* x, float* y, float a, float b, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}

struct Affine { float a, b; int n, pad; };
extern "C" __global__ void affine(const float* x, float* y, Affine p) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) y[i] = p.a * x[i] + p.b;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
extern "C" __global__ void tensor_core_only(float* x) {}
#endif
"""


def check(result):
    err, *values = result
    assert err == OK, f"{err!r}: {cu.last_error_message()}"
    return values[0] if len(values) == 1 else tuple(values) if values else None


def fails(result, code):
    err, *values = result
    assert err == code, f"expected {code!r}, got {err!r} ({cu.last_error_message()})"
    assert all(value is None for value in values)
    return cu.last_error_message()


class Device:
    """The device as the provider sets it up: cuInit, primary context current, one module of kernels."""

    def __init__(self):
        cu.reset()
        check(cu.cuInit(0))
        self.dev = check(cu.cuDeviceGet(0))
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.dev))
        check(cu.cuCtxSetCurrent(self.ctx))
        self.module = check(cu.cuModuleLoadData(cu.make_image(KERNELS, ["-DTILE=256", "--gpu-architecture=sm_90"])))
        self.functions = {}

    def __getitem__(self, name: str):
        if name not in self.functions:
            self.functions[name] = check(cu.cuModuleGetFunction(self.module, name.encode()))
        return self.functions[name]

    def upload(self, array: np.ndarray) -> int:
        ptr = check(cu.cuMemAlloc(max(array.nbytes, 1)))
        check(cu.cuMemcpyHtoD(ptr, np.ascontiguousarray(array), array.nbytes))
        return int(ptr)

    def zeros(self, shape, dtype) -> int:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        ptr = check(cu.cuMemAlloc(nbytes))
        check(cu.cuMemsetD8(ptr, 0, nbytes))
        return int(ptr)

    def download(self, ptr: int, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        check(cu.cuMemcpyDtoH(out, ptr, out.nbytes))
        return out

    def launch(self, name, grid, block, *args, shared=0, stream=0):
        values = tuple(value for value, _ in args)
        types = tuple(ctype for _, ctype in args)
        return cu.cuLaunchKernel(self[name], *grid, *block, shared, stream, (values, types), 0)

    def free(self, *ptrs):
        for ptr in ptrs:
            check(cu.cuMemFree(ptr))


def ptr(value: int):
    return (value, ctypes.c_void_p)


@pytest.fixture(scope="module")
def device():
    device = Device()
    yield device
    cu.reset()


@pytest.fixture(autouse=True)
def no_leaks(request):
    """Every test frees what it allocates (graph-internal memory included, via cuMemGetInfo)."""
    if "device" not in request.fixturenames:
        yield
        return
    request.getfixturevalue("device")
    before, (free_before, _) = cu.live_allocations(), check(cu.cuMemGetInfo())
    yield
    assert cu.live_allocations() == before
    assert check(cu.cuMemGetInfo())[0] == free_before


# ---- kernels -------------------------------------------------------------------------------------------------


def test_kernel_names_follow_preprocessing(device):
    library = compiler.load(KERNELS, ["-DTILE=256", "--gpu-architecture=sm_90"])
    assert library.path.parent == compiler.cache_dir() and library.path.is_file()  # compiled once, reused
    assert {"block_sum", "reverse_block", "affine"} <= set(library.kernels)
    assert "tensor_core_only" not in library.kernels  # only in the __CUDA_ARCH__ >= 800 branch
    assert library.max_threads["block_sum"] == 256  # from __launch_bounds__(TILE)
    attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
    assert check(cu.cuFuncGetAttribute(attribute, device["block_sum"])) == 256
    fails(device.launch("block_sum", (1, 1, 1), (512, 1, 1), ptr(0), ptr(0), (0, ctypes.c_longlong)),
          cu.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)


def test_kernel_scan_reads_the_preprocessed_declarations():
    source = """
    extern "C" __global__ void __launch_bounds__((128 * 2), 2) bounded(int x) {}
    extern "C" {
    __global__ void in_block(float* y) {}
    }
    __global__ void cpp_linkage(int) {}
    extern "C" __global__ void declared_only(int);
    """
    assert compiler.scan_kernels(source) == {"bounded": 256, "in_block": 0}
    with pytest.raises(compiler.CompileError):
        compiler.scan_kernels('extern "C" __global__ something odd;')


def test_block_sum_reduction(device):
    n = 1 << 20
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    dx, dout = device.upload(x), device.zeros(1, np.float32)
    check(device.launch("block_sum", (n // 256, 1, 1), (256, 1, 1), ptr(dx), ptr(dout), (n, ctypes.c_longlong)))
    np.testing.assert_allclose(device.download(dout, 1, np.float32)[0], x.astype(np.float64).sum(), rtol=1e-5)
    device.free(dx, dout)


def test_1024_thread_blocks_with_many_barriers(device):
    x = np.random.default_rng(1).integers(-100, 100, size=(3, 1024), dtype=np.int32)
    dx, dy = device.upload(x), device.zeros(x.shape, np.int32)
    check(device.launch("block_scan", (3, 1, 1), (32, 8, 4), ptr(dx), ptr(dy)))
    np.testing.assert_array_equal(device.download(dy, x.shape, np.int32), np.cumsum(x, axis=1))
    device.free(dx, dy)


def test_dynamic_shared_memory(device):
    x = np.arange(4 * 128, dtype=np.float32)
    dx, dy = device.upload(x), device.zeros(x.shape, np.float32)
    check(device.launch("reverse_block", (4, 1, 1), (128, 1, 1), ptr(dx), ptr(dy), shared=128 * 4))
    np.testing.assert_array_equal(device.download(dy, x.shape, np.float32), x.reshape(4, 128)[:, ::-1].ravel())

    count = 1000
    out = device.zeros(count + 1, np.uint8)
    check(device.launch("shared_bytes", (1, 1, 1), (64, 1, 1), ptr(out), (count, ctypes.c_int), shared=count))
    got = device.download(out, count + 1, np.uint8)
    np.testing.assert_array_equal(got[:count], ((np.arange(count) * 7) % 256).astype(np.uint8)[::-1])
    assert got[count] == 1  # 16-byte aligned
    # Reading past the launch's shared bytes hits a guard page, as an overrun faults on the GPU.
    message = fails(device.launch("shared_bytes", (1, 1, 1), (64, 1, 1), ptr(out), (count, ctypes.c_int),
                                  shared=count - 100), cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert "dynamic shared memory" in message
    # More than 48 KiB needs the function attribute first, as on a GPU.
    big = 64 * 1024
    fails(device.launch("shared_bytes", (1, 1, 1), (64, 1, 1), ptr(out), (count, ctypes.c_int), shared=big),
          cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(cu.cuFuncSetAttribute(device["shared_bytes"], attribute, big))
    check(device.launch("shared_bytes", (1, 1, 1), (64, 1, 1), ptr(out), (count, ctypes.c_int), shared=big))
    device.free(dx, dy, out)


def test_histogram_with_atomics_across_blocks(device):
    data = np.random.default_rng(2).integers(0, 256, size=100_000, dtype=np.uint8)
    ddata, dbins = device.upload(data), device.zeros(256, np.uint32)
    check(device.launch("histogram", (37, 1, 1), (128, 1, 1), ptr(ddata), (data.size, ctypes.c_longlong), ptr(dbins)))
    np.testing.assert_array_equal(device.download(dbins, 256, np.uint32), np.bincount(data, minlength=256))
    device.free(ddata, dbins)


def test_atomic_flavours(device):
    threads = 8 * 64
    i32 = device.upload(np.array([-1, 0, 0, -1, 0, 0], np.int32))
    u64, f32, f64 = device.zeros(1, np.uint64), device.zeros(1, np.float32), device.zeros(1, np.float64)
    check(device.launch("atomics", (8, 1, 1), (64, 1, 1), ptr(i32), ptr(u64), ptr(f32), ptr(f64)))
    ints = device.download(i32, 6, np.int32)
    assert list(ints) == [threads - 1, -(threads - 1), -1, -0x10000, 3 * threads, 7]
    assert device.download(u64, 1, np.uint64)[0] == threads * (threads - 1) // 2
    assert device.download(f32, 1, np.float32)[0] == 0.25 * threads
    assert device.download(f64, 1, np.float64)[0] == 0.5 * threads
    device.free(i32, u64, f32, f64)


def test_half_and_bfloat16_conversions_match_ml_dtypes(device):
    rng = np.random.default_rng(3)
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, 1e6, 2.0**-14, 2.0**-24, 2.0**-25,
                        1.5 * 2.0**-25, 3 * 2.0**-25, 2.5 * 2.0**-24, 1e-9, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
                        np.inf, -np.inf, 3.3895314e38], np.float32)
    bits = rng.integers(0, 2**32, size=20_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, bits[np.isfinite(bits)], rng.standard_normal(5000).astype(np.float32) * 1e3,
                        np.array([np.nan, -np.nan], np.float32)])
    n = x.size
    dx = device.upload(x)
    outs = [device.zeros(n, dtype) for dtype in (np.uint16, np.uint16, np.float32, np.float32)]
    check(device.launch("convert", ((n + 255) // 256, 1, 1), (256, 1, 1), ptr(dx), *map(ptr, outs),
                        (n, ctypes.c_longlong)))
    h_bits, b_bits = (device.download(p, n, np.uint16) for p in outs[:2])
    h_back, b_back = (device.download(p, n, np.float32) for p in outs[2:])
    finite = ~np.isnan(x)
    with np.errstate(over="ignore"):  # overflow to infinity is one of the cases under test
        as_half, as_bf16 = x[finite].astype(np.float16), x[finite].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(h_bits[finite], as_half.view(np.uint16))
    np.testing.assert_array_equal(b_bits[finite], as_bf16.view(np.uint16))
    np.testing.assert_array_equal(h_back[finite], as_half.astype(np.float32))
    np.testing.assert_array_equal(b_back[finite], as_bf16.astype(np.float32))
    assert (h_bits[~finite] == 0x7FFF).all() and (b_bits[~finite] == 0x7FFF).all()  # CUDA's canonical NaN
    assert np.isnan(h_back[~finite]).all() and np.isnan(b_back[~finite]).all()
    device.free(dx, *outs)

    # Every half survives float -> half -> float exactly.
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    every = every[~np.isnan(every)]
    n = every.size
    dall = device.upload(every.astype(np.float32))
    outs = [device.zeros(n, dtype) for dtype in (np.uint16, np.uint16, np.float32, np.float32)]
    check(device.launch("convert", ((n + 255) // 256, 1, 1), (256, 1, 1), ptr(dall), *map(ptr, outs),
                        (n, ctypes.c_longlong)))
    np.testing.assert_array_equal(device.download(outs[0], n, np.uint16), every.view(np.uint16))
    np.testing.assert_array_equal(device.download(outs[2], n, np.float32), every.astype(np.float32))
    device.free(dall, *outs)


def test_half_and_bfloat16_arithmetic(device):
    rng = np.random.default_rng(4)
    n = 3000
    a, b = (rng.standard_normal(n).astype(np.float16) * 50 for _ in range(2))
    c, d = (rng.standard_normal(n).astype(ml_dtypes.bfloat16) for _ in range(2))
    pa, pb, pc, pd = (device.upload(v) for v in (a, b, c, d))
    out, bout = device.zeros(3 * n, np.float16), device.zeros(2 * n, np.uint16)
    check(device.launch("half_math", ((n + 127) // 128, 1, 1), (128, 1, 1), ptr(pa), ptr(pb), ptr(out), ptr(pc),
                        ptr(pd), ptr(bout), (n, ctypes.c_int)))
    got = device.download(out, (n, 3), np.float16)
    np.testing.assert_array_equal(got[:, 0], a + b)
    np.testing.assert_array_equal(got[:, 1], a * b)
    np.testing.assert_array_equal(got[:, 2], np.maximum(a, b))
    bgot = device.download(bout, (n, 2), np.uint16).view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bgot[:, 0], c + d)
    np.testing.assert_array_equal(bgot[:, 1], c * d)
    device.free(pa, pb, pc, pd, out, bout)


def test_threads_returning_before_a_barrier(device):
    n = 300  # the second block keeps 44 of 256 threads
    x = np.arange(n, dtype=np.float32)
    dx, dy = device.upload(x), device.zeros(n, np.float32)
    check(device.launch("early_exit", (2, 1, 1), (256, 1, 1), ptr(dx), ptr(dy), (n, ctypes.c_int)))
    expected = np.concatenate([2 * x[:256][::-1], 2 * x[256:][::-1]])
    np.testing.assert_array_equal(device.download(dy, n, np.float32), expected)
    device.free(dx, dy)


def test_warp_votes_and_shuffles(device):
    threads = 48
    out = device.zeros(8 * threads, np.int32)
    check(device.launch("warp_ops", (1, 1, 1), (threads, 1, 1), ptr(out)))
    got = device.download(out, (threads, 8), np.int32)
    t = np.arange(threads)
    for warp in (0, 1):
        lanes = t[warp * 32: (warp + 1) * 32]
        ballot = sum(1 << int(lane - warp * 32) for lane in lanes if lane % 3 == 0)
        assert (got[lanes, 0].view(np.uint32) == ballot).all()
        assert (got[lanes, 1] == int(40 in lanes)).all()
        assert (got[lanes, 2] == int((lanes < 40).all())).all()
    full = t[:32]  # shuffle sources in the partial warp 1 do not exist: undefined on a GPU, not checked
    assert (got[full, 3] == full.sum()).all()
    np.testing.assert_array_equal(got[full, 4], np.cumsum(full))
    assert (got[full, 5] == 30).all()
    np.testing.assert_array_equal(got[full, 6], np.where(full % 8 == 7, full, full + 1))
    assert (got[:, 7] == threads // 2).all()
    device.free(out)


# ---- errors ----------------------------------------------------------------------------------------------


def test_kernel_faults_become_launch_errors(device):
    out = check(cu.cuMemAlloc(1024 * 4))
    check(device.launch("write_index", (4, 1, 1), (256, 1, 1), ptr(int(out)), (1024, ctypes.c_longlong)))
    message = fails(device.launch("write_index", (5, 1, 1), (256, 1, 1), ptr(int(out)), (1025, ctypes.c_longlong)),
                    cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    assert "write_index" in message and "illegal memory access" in message
    assert "deadlocked" in fails(device.launch("deadlock", (1, 1, 1), (64, 1, 1), ptr(int(out))),
                                 cu.CUresult.CUDA_ERROR_LAUNCH_FAILED)
    assert "__trap()" in fails(device.launch("trap_if", (2, 1, 1), (32, 1, 1), (1, ctypes.c_int)),
                               cu.CUresult.CUDA_ERROR_LAUNCH_FAILED)
    hog = device.launch("stack_hog", (1, 1, 1), (32, 1, 1), ptr(int(out)), (5, ctypes.c_int))
    assert "stack overflow" in fails(hog, cu.CUresult.CUDA_ERROR_LAUNCH_FAILED)
    message = fails(device.launch("trap_if", (2, 1, 1), (32, 1, 1), (2, ctypes.c_int)), cu.CUresult.CUDA_ERROR_ASSERT)
    assert "assertion `flag != 2 || threadIdx.x != 7` failed" in message and "thread (7,0,0)" in message
    check(device.launch("trap_if", (2, 1, 1), (32, 1, 1), (0, ctypes.c_int)))  # the simulator keeps working
    check(cu.cuMemFree(out))


def test_error_codes(device):
    assert check(cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)) == b"CUDA_ERROR_ILLEGAL_ADDRESS"
    assert check(cu.cuGetErrorString(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)) == b"out of memory"
    fails(cu.cuModuleGetFunction(device.module, b"no_such_kernel"), cu.CUresult.CUDA_ERROR_NOT_FOUND)
    with pytest.raises(TypeError):
        cu.cuModuleGetFunction(device.module, "block_sum")  # names are bytes, as in cuda-python
    fails(cu.cuModuleLoadData(b"\x7fELF not a simulator image"), cu.CUresult.CUDA_ERROR_INVALID_IMAGE)

    ptr_ = check(cu.cuMemAlloc(64))
    fails(cu.cuMemFree(int(ptr_) + 8), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    fails(cu.cuMemFree(0xDEAD0000), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    host = np.zeros(32, np.uint8)
    fails(cu.cuMemcpyDtoH(host, int(ptr_) + 48, 32), cu.CUresult.CUDA_ERROR_INVALID_VALUE)  # past the end
    fails(cu.cuMemcpyHtoD(ptr_, np.zeros(8, np.uint8), 16), cu.CUresult.CUDA_ERROR_INVALID_VALUE)  # short host
    fails(cu.cuMemcpyDtoH(bytes(64), ptr_, 64), cu.CUresult.CUDA_ERROR_INVALID_VALUE)  # read-only host buffer
    with pytest.raises(TypeError):
        cu.cuMemcpyHtoD(ptr_, [1, 2, 3], 3)
    check(cu.cuMemFree(ptr_))
    fails(cu.cuMemFree(ptr_), cu.CUresult.CUDA_ERROR_INVALID_VALUE)  # double free
    fails(cu.cuMemcpyHtoD(ptr_, host, 8), cu.CUresult.CUDA_ERROR_INVALID_VALUE)  # freed
    fails(cu.cuMemAlloc(0), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    fails(cu.cuMemAlloc(1 << 50), cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)

    fails(cu.cuStreamSynchronize(cu.CUstream(0x1234)), cu.CUresult.CUDA_ERROR_INVALID_HANDLE)
    fails(cu.cuEventRecord(cu.CUevent(0x1234), 0), cu.CUresult.CUDA_ERROR_INVALID_HANDLE)
    fails(cu.cuGraphLaunch(cu.CUgraphExec(0x1234), 0), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    fails(cu.cuDeviceGet(1), cu.CUresult.CUDA_ERROR_INVALID_DEVICE)

    # Kernel arguments must match the parameter list: count, size and floating-point-ness.
    f32 = (0, ctypes.c_void_p)
    fails(device.launch("axpb", (1, 1, 1), (32, 1, 1), f32, f32, (1.0, ctypes.c_float), (0.0, ctypes.c_float)),
          cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    message = fails(device.launch("axpb", (1, 1, 1), (32, 1, 1), f32, f32, (1.0, ctypes.c_float),
                                  (0.0, ctypes.c_float), (4, ctypes.c_longlong)), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert "parameter 4 is a 4-byte signed integer" in message
    fails(device.launch("axpb", (1, 1, 1), (32, 1, 1), f32, f32, (1, ctypes.c_int), (0.0, ctypes.c_float),
                        (4, ctypes.c_int)), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    fails(device.launch("axpb", (0, 1, 1), (32, 1, 1)), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    fails(device.launch("axpb", (1, 1, 1), (2048, 1, 1)), cu.CUresult.CUDA_ERROR_INVALID_VALUE)


def test_context_is_per_thread_and_threads_share_the_device(device):
    with ThreadPoolExecutor(4) as pool:
        fails(pool.submit(cu.cuMemAlloc, 16).result(), cu.CUresult.CUDA_ERROR_INVALID_CONTEXT)  # not current there
        n = 4096
        x = np.arange(n, dtype=np.float32)
        dx, outs = device.upload(x), [device.zeros(n, np.float32) for _ in range(4)]

        def worker(out: int, scale: float):
            check(cu.cuCtxSetCurrent(device.ctx))
            for _ in range(5):
                check(device.launch("axpb", (n // 256, 1, 1), (256, 1, 1), ptr(dx), ptr(out), (scale, ctypes.c_float),
                                    (0.0, ctypes.c_float), (n, ctypes.c_int)))

        for future in [pool.submit(worker, out, float(i)) for i, out in enumerate(outs)]:
            future.result()
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(device.download(out, n, np.float32), i * x)
    device.free(dx, *outs)


def test_compile_errors_carry_the_compiler_log():
    with pytest.raises(compiler.CompileError) as info:
        cu.make_image('extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }', [])
    assert "undefined_name" in info.value.log


def test_struct_and_raw_pointer_parameters(device):
    class Affine(ctypes.Structure):
        _fields_ = [("a", ctypes.c_float), ("b", ctypes.c_float), ("n", ctypes.c_int), ("pad", ctypes.c_int)]

    x = np.arange(10, dtype=np.float32)
    dx, dy = device.upload(x), device.zeros(10, np.float32)
    check(device.launch("affine", (1, 1, 1), (32, 1, 1), ptr(dx), ptr(dy), (Affine(3.0, 1.0, 10, 0), None)))
    np.testing.assert_array_equal(device.download(dy, 10, np.float32), 3 * x + 1)
    # A void** of parameter addresses (the C API form), handed over as an int.
    values = [ctypes.c_uint64(dx), ctypes.c_uint64(dy), ctypes.c_float(-1.0), ctypes.c_float(0.5), ctypes.c_int(10)]
    pointers = (ctypes.c_void_p * 5)(*(ctypes.addressof(v) for v in values))
    check(cu.cuLaunchKernel(device["axpb"], 1, 1, 1, 32, 1, 1, 0, 0, ctypes.addressof(pointers), 0))
    np.testing.assert_array_equal(device.download(dy, 10, np.float32), 0.5 - x)
    device.free(dx, dy)


# ---- streams, events, capture and graphs ----------------------------------------------------------------------


def test_device_queries_and_events(device):
    attribute = cu.CUdevice_attribute
    assert check(cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device.dev)) == 9
    assert check(cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_WARP_SIZE, device.dev)) == 32
    assert check(cu.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, device.dev)) == 1024
    name = check(cu.cuDeviceGetName(256, device.dev))
    assert len(name) == 256 and name.split(b"\x00")[0].startswith(b"CUDA Simulator")
    assert check(cu.cuCtxGetCurrent()) == device.ctx
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    start, end = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    fails(cu.cuEventElapsedTime(start, end), cu.CUresult.CUDA_ERROR_INVALID_HANDLE)  # not recorded yet
    check(cu.cuEventRecord(start, stream))
    check(cu.cuEventRecord(end, stream))
    check(cu.cuStreamWaitEvent(0, end, 0))
    check(cu.cuEventSynchronize(end))
    check(cu.cuEventQuery(end))
    assert check(cu.cuEventElapsedTime(start, end)) >= 0.0
    check(cu.cuStreamQuery(stream))
    for event in (start, end):
        check(cu.cuEventDestroy(event))
    check(cu.cuStreamDestroy(stream))
    fails(cu.cuStreamDestroy(stream), cu.CUresult.CUDA_ERROR_INVALID_HANDLE)


def test_stream_ordered_pool(device):
    attribute = cu.CUmemPool_attribute
    pool = check(cu.cuDeviceGetDefaultMemPool(device.dev))
    check(cu.cuMemPoolSetAttribute(pool, attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, cu.cuuint64_t(2**64 - 1)))
    assert int(check(cu.cuMemPoolGetAttribute(pool, attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD))) == 2**64 - 1
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    used = int(check(cu.cuMemPoolGetAttribute(pool, attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)))
    buffer = check(cu.cuMemAllocAsync(1000, stream))
    assert int(check(cu.cuMemPoolGetAttribute(pool, attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT))) == used + 1000
    check(cu.cuMemFreeAsync(buffer, stream))
    fails(cu.cuMemFreeAsync(buffer, stream), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    assert int(check(cu.cuMemPoolGetAttribute(pool, attribute.CU_MEMPOOL_ATTR_USED_MEM_HIGH))) >= used + 1000
    check(cu.cuStreamDestroy(stream))


def _capture(stream, mode=cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL):
    check(cu.cuStreamBeginCapture(stream, mode))
    assert check(cu.cuStreamIsCapturing(stream)) == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE


def test_capture_and_replay_match_eager_execution(device):
    n = 1000
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    x_host, y_host = np.arange(n, dtype=np.float32), np.zeros(n, np.float32)
    dx, dy = int(check(cu.cuMemAlloc(4 * n))), int(check(cu.cuMemAlloc(4 * n)))
    scale = ctypes.c_float(2.0)
    args = (ptr(dx), ptr(dy), (scale, ctypes.c_float), (1.0, ctypes.c_float), (n, ctypes.c_int))

    def work():
        check(cu.cuMemcpyHtoDAsync(dx, x_host, 4 * n, stream))
        check(device.launch("axpb", ((n + 255) // 256, 1, 1), (256, 1, 1), *args, stream=stream))
        check(cu.cuMemcpyDtoHAsync(y_host, dy, 4 * n, stream))

    work()
    eager = y_host.copy()
    np.testing.assert_array_equal(eager, 2 * x_host + 1)

    y_host[:] = 0
    _capture(stream)
    work()
    graph = check(cu.cuStreamEndCapture(stream))
    assert check(cu.cuStreamIsCapturing(stream)) == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    assert not y_host.any()  # captured work does not run
    execution = check(cu.cuGraphInstantiate(graph, 0))
    check(cu.cuGraphLaunch(execution, stream))
    check(cu.cuStreamSynchronize(stream))
    np.testing.assert_array_equal(y_host, eager)

    # Replay reads the host buffers at replay time but keeps the kernel arguments captured at record time.
    scale.value = 5.0
    x_host[:] = 10.0
    check(cu.cuGraphLaunch(execution, stream))
    np.testing.assert_array_equal(y_host, np.full(n, 21.0, np.float32))

    check(cu.cuGraphExecDestroy(execution))
    check(cu.cuGraphDestroy(graph))
    fails(cu.cuGraphLaunch(execution, stream), cu.CUresult.CUDA_ERROR_INVALID_VALUE)
    check(cu.cuStreamDestroy(stream))
    device.free(dx, dy)


def test_captured_allocations_belong_to_the_graph(device):
    n = 256
    stream = check(cu.cuStreamCreate(0))
    dx, dy = device.upload(np.ones(n, np.float32)), device.zeros(n, np.float32)
    _capture(stream)
    tmp = int(check(cu.cuMemAllocAsync(4 * n, stream)))
    check(device.launch("axpb", (1, 1, 1), (n, 1, 1), ptr(dx), ptr(tmp), (3.0, ctypes.c_float), (0.0, ctypes.c_float),
                        (n, ctypes.c_int), stream=stream))
    check(device.launch("axpb", (1, 1, 1), (n, 1, 1), ptr(tmp), ptr(dy), (1.0, ctypes.c_float), (1.0, ctypes.c_float),
                        (n, ctypes.c_int), stream=stream))
    check(cu.cuMemFreeAsync(tmp, stream))
    graph = check(cu.cuStreamEndCapture(stream))
    assert tmp not in cu.live_allocations()
    execution = check(cu.cuGraphInstantiate(graph, 0))
    for _ in range(2):
        check(cu.cuGraphLaunch(execution, stream))
        np.testing.assert_array_equal(device.download(dy, n, np.float32), np.full(n, 4.0, np.float32))
    check(cu.cuGraphExecDestroy(execution))
    check(cu.cuGraphDestroy(graph))  # the graph's memory goes with it: no_leaks checks cuMemGetInfo
    check(cu.cuStreamDestroy(stream))
    device.free(dx, dy)


def test_illegal_calls_invalidate_a_capture(device):
    stream = check(cu.cuStreamCreate(0))
    buf = check(cu.cuMemAlloc(64))
    _capture(stream)
    fails(cu.cuMemcpyHtoD(buf, bytes(64), 64), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    assert check(cu.cuStreamIsCapturing(stream)) == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_INVALIDATED
    fails(cu.cuMemsetD8Async(buf, 0, 64, stream), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    fails(cu.cuStreamEndCapture(stream), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    fails(cu.cuStreamEndCapture(stream), cu.CUresult.CUDA_ERROR_ILLEGAL_STATE)

    _capture(stream)
    fails(cu.cuStreamSynchronize(stream), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    fails(cu.cuStreamEndCapture(stream), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)

    _capture(stream)  # the legacy stream may not run work beside a capturing blocking stream
    fails(cu.cuMemsetD8Async(buf, 0, 64, 0), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    fails(cu.cuStreamEndCapture(stream), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    fails(cu.cuStreamBeginCapture(0, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL),
          cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
    check(cu.cuMemFree(buf))
    check(cu.cuStreamDestroy(stream))


def test_forked_streams_must_join_before_the_capture_ends(device):
    main, side = (check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)) for _ in range(2))
    fork, join = check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))
    out = device.zeros(2, np.int32)

    def fork_work(join_back: bool):
        _capture(main)
        check(cu.cuMemsetD32Async(out, 1, 1, main))
        check(cu.cuEventRecord(fork, main))
        check(cu.cuStreamWaitEvent(side, fork, 0))  # side joins the capture
        assert check(cu.cuStreamIsCapturing(side)) == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
        check(cu.cuMemsetD32Async(out + 4, 2, 1, side))
        if join_back:
            check(cu.cuEventRecord(join, side))
            check(cu.cuStreamWaitEvent(main, join, 0))
        return cu.cuStreamEndCapture(main)

    fails(fork_work(join_back=False), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
    graph = check(fork_work(join_back=True))
    assert check(cu.cuStreamIsCapturing(side)) == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
    np.testing.assert_array_equal(device.download(out, 2, np.int32), [0, 0])
    execution = check(cu.cuGraphInstantiate(graph, 0))
    check(cu.cuGraphLaunch(execution, main))
    np.testing.assert_array_equal(device.download(out, 2, np.int32), [1, 2])
    # An event recorded outside the capture cannot be waited on inside it.
    check(cu.cuEventRecord(fork, side))
    _capture(main)
    fails(cu.cuStreamWaitEvent(main, fork, 0), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION)
    fails(cu.cuStreamEndCapture(main), cu.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    check(cu.cuGraphExecDestroy(execution))
    check(cu.cuGraphDestroy(graph))
    for handle in (fork, join):
        check(cu.cuEventDestroy(handle))
    for handle in (main, side):
        check(cu.cuStreamDestroy(handle))
    device.free(out)


def test_releasing_the_context_frees_everything():
    device = Device()
    check(cu.cuMemAlloc(1024))
    assert cu.live_allocations()
    check(cu.cuModuleUnload(device.module))
    check(cu.cuDevicePrimaryCtxRelease(device.dev))
    assert cu.live_allocations() == {}
    fails(cu.cuMemAlloc(16), cu.CUresult.CUDA_ERROR_INVALID_CONTEXT)
    cu.reset()
    fails(cu.cuDeviceGetCount(), cu.CUresult.CUDA_ERROR_NOT_INITIALIZED)
