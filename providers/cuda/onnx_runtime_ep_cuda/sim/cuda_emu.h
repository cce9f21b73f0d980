// cuda_emu.h: CUDA C++ kernels compiled by g++ and executed on the CPU, for the simulated driver.
//
// The simulator (sim/compiler.py) compiles a kernel source as one translation unit with this header
// force-included, appends ORT_SIM_REGISTER(name) for every extern "C" __global__ function, and loads the
// shared object with ctypes. The C ABI at the bottom (ort_sim_launch and friends) is all it calls.
//
// Execution model: the blocks of a grid run one after another on the calling thread; the threads of a
// block are cooperative fibers with their own small stacks that switch only at __syncthreads and at warp
// collectives. Because nothing else can run between two switch points, a plain read-modify-write is
// atomic, and __shared__ can be function-static storage (one block is alive at a time).
//
// Fidelity choices that make kernel bugs visible instead of silent:
//  - a thread that returns leaves every later barrier (early exit before a final __syncthreads works);
//  - a warp collective waits only for the live lanes named in its mask, so a tail run by one warp works;
//  - a block that can make no progress (a barrier some threads never reach) fails the launch with
//    CUDA_ERROR_LAUNCH_FAILED and a description instead of hanging;
//  - dynamic shared memory ends at a guard page, so reading past the launch's shared_bytes faults;
//  - faults (SIGSEGV/SIGBUS/SIGFPE) inside a launch become CUDA_ERROR_ILLEGAL_ADDRESS/LAUNCH_FAILED.
// __CUDA_ARCH__ stays undefined, so `#if __CUDA_ARCH__ >= 800` tensor-core paths take their fallback.
#pragma once

#include <cfloat>
#include <climits>
#include <cmath>
#include <csetjmp>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <mutex>
#include <pthread.h>
#include <string>
#include <sys/mman.h>
#include <tuple>
#include <type_traits>
#include <unistd.h>
#include <utility>
#include <vector>

#if !defined(__x86_64__) || defined(ORT_SIM_USE_UCONTEXT)
#include <ucontext.h>
#define ORT_SIM_UCONTEXT 1
#endif

#undef __CUDA_ARCH__
#define ORT_CUDA_SIM 1

// ---- qualifiers -------------------------------------------------------------------------------------
// __restrict__ is already a g++ keyword. __shared__ is static storage: blocks never overlap in time.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__ static
#define __managed__

// ---- vector types ------------------------------------------------------------------------------------
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

#define ORT_SIM_VEC2(name, T, align)                                                                       \
    struct __attribute__((aligned(align))) name { T x, y; };                                              \
    __forceinline__ name make_##name(T x, T y) { return name{x, y}; }
#define ORT_SIM_VEC3(name, T)                                                                              \
    struct name { T x, y, z; };                                                                           \
    __forceinline__ name make_##name(T x, T y, T z) { return name{x, y, z}; }
#define ORT_SIM_VEC4(name, T, align)                                                                       \
    struct __attribute__((aligned(align))) name { T x, y, z, w; };                                        \
    __forceinline__ name make_##name(T x, T y, T z, T w) { return name{x, y, z, w}; }

ORT_SIM_VEC2(char2, signed char, 2) ORT_SIM_VEC4(char4, signed char, 4)
ORT_SIM_VEC2(uchar2, unsigned char, 2) ORT_SIM_VEC4(uchar4, unsigned char, 4)
ORT_SIM_VEC2(short2, short, 4) ORT_SIM_VEC4(short4, short, 8)
ORT_SIM_VEC2(ushort2, unsigned short, 4) ORT_SIM_VEC4(ushort4, unsigned short, 8)
ORT_SIM_VEC2(int2, int, 8) ORT_SIM_VEC3(int3, int) ORT_SIM_VEC4(int4, int, 16)
ORT_SIM_VEC2(uint2, unsigned int, 8) ORT_SIM_VEC4(uint4, unsigned int, 16)
ORT_SIM_VEC2(longlong2, long long, 16) ORT_SIM_VEC2(ulonglong2, unsigned long long, 16)
ORT_SIM_VEC2(float2, float, 8) ORT_SIM_VEC3(float3, float) ORT_SIM_VEC4(float4, float, 16)
ORT_SIM_VEC2(double2, double, 16)
__forceinline__ uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

// ---- runtime state -----------------------------------------------------------------------------------
namespace ort_sim {

enum : int {
    kSuccess = 0, kInvalidValue = 1, kOutOfMemory = 2, kNotFound = 500,
    kIllegalAddress = 700, kLaunchOutOfResources = 701, kAssert = 710, kLaunchFailed = 719,
};
constexpr unsigned kMaxThreads = 1024;
constexpr size_t kMaxDynamicShared = 232448;  // sm_90's opt-in maximum per block

enum class State : unsigned char { Ready, Running, AtBarrier, AtWarp, Done };
enum class WarpOp : unsigned char {
    Sync, ShflIdx, ShflUp, ShflDown, ShflXor, Ballot, Any, All,
    ReduceAdd, ReduceMin, ReduceMax, ReduceAnd, ReduceOr, ReduceXor,
};

#ifdef ORT_SIM_UCONTEXT
using Context = ucontext_t;
#else
using Context = void*;  // the saved stack pointer; callee-saved registers sit on that stack
#endif

struct Fiber {
    Context ctx;
    uint3 tid;
    unsigned lane, warp;
    State state;
    // __syncthreads_count/_and/_or: this thread's predicate, the count of true ones and of participants.
    int bar_pred, bar_count, bar_total;
    // The warp collective this thread waits in, and its answer.
    WarpOp op;
    bool op_signed;
    unsigned op_mask;
    int op_param, op_width;
    uint64_t op_value, op_result;
};

inline Fiber* g_cur = nullptr;  // the running fiber: threadIdx reads it
inline uint3 g_block_idx{0, 0, 0};
inline dim3 g_block_dim, g_grid_dim;
inline void* g_dynamic_shared = nullptr;  // start of this launch's extern __shared__ bytes

}  // namespace ort_sim

// Read-only views, as in CUDA. ORT_SIM_DYNAMIC_SHARED is what sim/compiler.py rewrites
// `extern __shared__ T name[];` into: a reference to the launch's pointer, valid at any scope.
#define threadIdx (static_cast<const uint3&>(::ort_sim::g_cur->tid))
#define blockIdx (static_cast<const uint3&>(::ort_sim::g_block_idx))
#define blockDim (static_cast<const dim3&>(::ort_sim::g_block_dim))
#define gridDim (static_cast<const dim3&>(::ort_sim::g_grid_dim))
#define ORT_SIM_DYNAMIC_SHARED(T, name) T* const& name = reinterpret_cast<T* const&>(::ort_sim::g_dynamic_shared)
constexpr int warpSize = 32;

#ifndef ORT_SIM_UCONTEXT
// Switch stacks: push the callee-saved registers, save rsp to *from, load `to`, pop, return into it.
extern "C" void ort_sim_swap(void** from, void* to);
asm(R"(
    .text
    .p2align 4
    .globl ort_sim_swap
    .hidden ort_sim_swap
    .type ort_sim_swap, @function
ort_sim_swap:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ort_sim_swap, .-ort_sim_swap
)");
#endif

namespace ort_sim {

struct Warp {
    unsigned live;     // lanes that exist and have not returned
    unsigned pending;  // lanes waiting in a collective
    unsigned mask;     // the mask those lanes passed, while `mixed` is false
    bool mixed;        // waiting lanes passed different masks (divergent collectives): take the slow path
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<unsigned> ready;  // ring buffer of fiber indices; each fiber is queued at most once
    size_t head = 0, count = 0;
    unsigned live = 0, at_barrier = 0;
    std::vector<Warp> warps;
    Context sched;

    void push(unsigned i) {
        fibers[i].state = State::Ready;
        size_t slot = head + count++;
        ready[slot >= ready.size() ? slot - ready.size() : slot] = i;
    }
    unsigned pop() {
        const unsigned i = ready[head];
        head = head + 1 == ready.size() ? 0 : head + 1;
        --count;
        return i;
    }
};

inline Block g_block;
inline void (*g_body)(void*) = nullptr;  // runs the kernel with the launch's arguments
inline void* g_body_arg = nullptr;

// Fiber stacks: one mapping, a PROT_NONE guard page below each stack, reused across launches.
struct Stacks {
    char* base = nullptr;
    size_t count = 0, stride = 0, guard = 0;
    char* top(unsigned i) const { return base + stride * (i + 1); }
    bool in_guard(const void* p) const {
        const char* c = static_cast<const char*>(p);
        if (!base || c < base || c >= base + stride * count) return false;
        return size_t(c - base) % stride < guard;
    }
};
inline Stacks g_stacks;

inline size_t g_stack_bytes = 0;

inline bool ensure_stacks(unsigned n) {
    const char* env = std::getenv("ONNX_RUNTIME_CUDA_SIM_STACK_KB");  // for kernels with large local arrays
    const long kb = env ? std::atol(env) : 64;
    g_stack_bytes = size_t(kb < 16 ? 16 : kb) * 1024;
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t stride = (g_stack_bytes + page - 1) / page * page + page;
    if (g_stacks.base && g_stacks.count >= n && g_stacks.stride == stride) return true;
    if (g_stacks.base) munmap(g_stacks.base, g_stacks.count * g_stacks.stride);
    g_stacks = Stacks{};
    void* p = mmap(nullptr, stride * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    g_stacks = Stacks{static_cast<char*>(p), n, stride, page};
    for (unsigned i = 0; i < n; ++i) mprotect(g_stacks.base + size_t(i) * stride, page, PROT_NONE);
    return true;
}

// Dynamic shared memory: the launch's bytes end exactly at a guard page, so overruns fault.
struct DynamicShared {
    char* base = nullptr;
    size_t usable = 0;
    bool contains(const void* p) const {
        const char* c = static_cast<const char*>(p);
        return base && c >= base && c < base + usable + size_t(sysconf(_SC_PAGESIZE));
    }
};
inline DynamicShared g_shared;

inline bool place_dynamic_shared(size_t bytes) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    if (!g_shared.base) {
        const size_t usable = (kMaxDynamicShared + page - 1) / page * page;
        void* p = mmap(nullptr, usable + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return false;
        g_shared = DynamicShared{static_cast<char*>(p), usable};
        mprotect(g_shared.base + usable, page, PROT_NONE);
    }
    g_dynamic_shared = g_shared.base + g_shared.usable - (bytes + 15) / 16 * 16;
    return true;
}

// Launch failure state: faults and __trap() jump back to the launch with a code and a message.
inline sigjmp_buf g_escape;
inline volatile sig_atomic_t g_in_launch = 0;
inline pthread_t g_launch_thread;
inline int g_error_code = 0;
inline char g_error[1024] = "";
inline std::string g_kernel_name;
constexpr int kFaultSignals[3] = {SIGSEGV, SIGBUS, SIGFPE};
inline struct sigaction g_previous_actions[3];

[[noreturn]] inline void fail(int code, const char* message) {
    g_error_code = code;
    std::snprintf(g_error, sizeof g_error, "%s", message);
    siglongjmp(g_escape, 1);
}

inline void describe_thread(char* out, size_t size) {
    if (!g_cur) { std::snprintf(out, size, "outside any thread"); return; }
    std::snprintf(out, size, "block (%u,%u,%u) thread (%u,%u,%u)", g_block_idx.x, g_block_idx.y, g_block_idx.z,
                  g_cur->tid.x, g_cur->tid.y, g_cur->tid.z);
}

inline void on_fault(int sig, siginfo_t* info, void*) {
    if (!g_in_launch || !pthread_equal(pthread_self(), g_launch_thread)) {
        // Not a kernel's fault: reinstate the process's own handler; the faulting instruction reruns into it.
        for (int i = 0; i < 3; ++i) {
            if (kFaultSignals[i] == sig) sigaction(sig, &g_previous_actions[i], nullptr);
        }
        return;
    }
    g_in_launch = 0;
    char where[128];
    describe_thread(where, sizeof where);
    const void* addr = info->si_addr;
    if (sig == SIGFPE) {
        g_error_code = kLaunchFailed;
        std::snprintf(g_error, sizeof g_error, "kernel %s: arithmetic exception (integer division by zero?) in %s",
                      g_kernel_name.c_str(), where);
    } else if (g_stacks.in_guard(addr)) {
        g_error_code = kLaunchFailed;
        std::snprintf(g_error, sizeof g_error,
                      "kernel %s: thread stack overflow in %s (raise ONNX_RUNTIME_CUDA_SIM_STACK_KB, now %zu)",
                      g_kernel_name.c_str(), where, g_stack_bytes / 1024);
    } else if (g_shared.contains(addr)) {
        g_error_code = kIllegalAddress;
        std::snprintf(g_error, sizeof g_error,
                      "kernel %s: access to %p is past the launch's dynamic shared memory in %s",
                      g_kernel_name.c_str(), addr, where);
    } else {
        g_error_code = kIllegalAddress;
        std::snprintf(g_error, sizeof g_error, "kernel %s: illegal memory access at %p in %s",
                      g_kernel_name.c_str(), addr, where);
    }
    siglongjmp(g_escape, 1);
}

// Installs the fault handlers (on an alternate stack, so a stack overflow can still be reported) for
// the duration of one launch and restores whatever the process had before.
class FaultGuard {
  public:
    FaultGuard() {
        stack_t current;
        sigaltstack(nullptr, &current);
        if (current.ss_flags & SS_DISABLE) {
            static char alt[64 * 1024];
            stack_t mine{};
            mine.ss_sp = alt;
            mine.ss_size = sizeof alt;
            sigaltstack(&mine, &previous_stack_);
            restore_stack_ = true;
        }
        struct sigaction action{};
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        for (int i = 0; i < 3; ++i) sigaction(kFaultSignals[i], &action, &g_previous_actions[i]);
        g_launch_thread = pthread_self();
        g_in_launch = 1;
    }
    ~FaultGuard() {
        g_in_launch = 0;
        for (int i = 0; i < 3; ++i) sigaction(kFaultSignals[i], &g_previous_actions[i], nullptr);
        if (restore_stack_) sigaltstack(&previous_stack_, nullptr);
    }

  private:
    stack_t previous_stack_{};
    bool restore_stack_ = false;
};

// ---- scheduling ----------------------------------------------------------------------------------------
inline void switch_context(Context* from, Context* to) {
#ifdef ORT_SIM_UCONTEXT
    swapcontext(from, to);
#else
    ort_sim_swap(from, *to);
#endif
}

// Suspends the running thread and resumes the next ready one directly (one switch, not two via the
// scheduler); with nothing ready, control returns to the scheduler, which ends or reports the block.
inline void yield() {
    Block& b = g_block;
    Fiber* self = g_cur;
    if (!b.count) {
        switch_context(&self->ctx, &b.sched);
        return;
    }
    Fiber* next = &b.fibers[b.pop()];
    next->state = State::Running;
    if (next == self) return;
    g_cur = next;
    switch_context(&self->ctx, &next->ctx);
}

// Everyone live has arrived: hand each thread the predicate tallies and requeue all in thread order.
inline void release_barrier() {
    Block& b = g_block;
    int count = 0;
    for (const Fiber& f : b.fibers) count += f.state == State::AtBarrier && f.bar_pred != 0;
    for (unsigned i = 0; i < b.fibers.size(); ++i) {
        Fiber& f = b.fibers[i];
        if (f.state != State::AtBarrier) continue;
        f.bar_count = count;
        f.bar_total = int(b.at_barrier);
        b.push(i);
    }
    b.at_barrier = 0;
}

inline uint64_t lane_value(const Fiber& f, unsigned src, unsigned group) {
    if (src >= 32 || !(group >> src & 1u)) return f.op_value;  // absent source lane: keep own value
    return (&f)[int(src) - int(f.lane)].op_value;               // lanes of a warp are adjacent fibers
}

inline uint32_t reduce(WarpOp op, bool is_signed, uint32_t a, uint32_t b) {
    switch (op) {
        case WarpOp::ReduceAdd: return a + b;
        case WarpOp::ReduceMin: return is_signed ? (int32_t(a) < int32_t(b) ? a : b) : (a < b ? a : b);
        case WarpOp::ReduceMax: return is_signed ? (int32_t(a) > int32_t(b) ? a : b) : (a > b ? a : b);
        case WarpOp::ReduceAnd: return a & b;
        case WarpOp::ReduceOr: return a | b;
        default: return a ^ b;
    }
}

// Computes every waiting lane's answer for a collective whose lanes (`group`) have all arrived, and
// requeues them in lane order.
inline void resolve_warp(unsigned warp, unsigned group) {
    Block& b = g_block;
    Fiber* lanes = &b.fibers[warp * 32];
    const Fiber& lead = lanes[__builtin_ctz(group)];
    unsigned ballot = 0;
    uint32_t reduced = 0;
    if (lead.op == WarpOp::Ballot || lead.op == WarpOp::Any || lead.op == WarpOp::All) {
        for (unsigned g = group; g; g &= g - 1) {
            const unsigned l = unsigned(__builtin_ctz(g));
            if (lanes[l].op_value) ballot |= 1u << l;
        }
    } else if (lead.op >= WarpOp::ReduceAdd) {
        reduced = uint32_t(lead.op_value);
        for (unsigned g = group & (group - 1); g; g &= g - 1) {
            reduced = reduce(lead.op, lead.op_signed, reduced, uint32_t(lanes[__builtin_ctz(g)].op_value));
        }
    }
    for (unsigned g = group; g; g &= g - 1) {
        const unsigned l = unsigned(__builtin_ctz(g));
        Fiber& f = lanes[l];
        const unsigned width = unsigned(f.op_width), param = unsigned(f.op_param);
        const unsigned first = l & ~(width - 1), last = first + width - 1;
        switch (f.op) {
            case WarpOp::Sync: f.op_result = 0; break;
            case WarpOp::ShflIdx: f.op_result = lane_value(f, first + (param & (width - 1)), group); break;
            case WarpOp::ShflUp:
                f.op_result = l - first >= param ? lane_value(f, l - param, group) : f.op_value;
                break;
            case WarpOp::ShflDown:
                f.op_result = l + param <= last ? lane_value(f, l + param, group) : f.op_value;
                break;
            case WarpOp::ShflXor:  // a lane may read an earlier segment, never a later one
                f.op_result = (l ^ param) <= last ? lane_value(f, l ^ param, group) : f.op_value;
                break;
            case WarpOp::Ballot: f.op_result = ballot & f.op_mask; break;
            case WarpOp::Any: f.op_result = (ballot & f.op_mask) != 0; break;
            case WarpOp::All: f.op_result = (ballot & f.op_mask) == (group & f.op_mask); break;
            default: f.op_result = reduced;
        }
        b.push(warp * 32 + l);
    }
    Warp& w = b.warps[warp];
    w.pending &= ~group;
    if (!w.pending) w.mixed = false;
}

// Slow path for divergent collectives: a collective completes when every live lane named in its mask
// waits in a collective with that same mask.
inline void try_complete(unsigned warp, unsigned mask) {
    Block& b = g_block;
    const Warp& w = b.warps[warp];
    unsigned group = 0;
    for (unsigned g = w.pending; g; g &= g - 1) {
        const unsigned l = unsigned(__builtin_ctz(g));
        if (b.fibers[warp * 32 + l].op_mask == mask) group |= 1u << l;
    }
    const unsigned needed = mask & w.live;
    if (group && (group & needed) == needed) resolve_warp(warp, group);
}

inline uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int param = 0, int width = 32,
                                bool is_signed = false) {
    Fiber& f = *g_cur;
    if (width <= 0 || width > 32 || (width & (width - 1))) width = 32;
    f.op = op;
    f.op_mask = mask;
    f.op_value = value;
    f.op_param = param;
    f.op_width = width;
    f.op_signed = is_signed;
    f.state = State::AtWarp;
    Warp& w = g_block.warps[f.warp];
    if (!w.pending) {
        w.mask = mask;
    } else if (w.mask != mask) {
        w.mixed = true;
    }
    w.pending |= 1u << f.lane;
    if (w.mixed) {
        try_complete(f.warp, mask);
    } else if ((w.pending & mask & w.live) == (mask & w.live)) {
        resolve_warp(f.warp, w.pending);
    }
    yield();
    return f.op_result;
}

// Returns this thread's copy of the tallies: (count of true predicates, number of participants).
inline std::pair<int, int> block_barrier(int pred) {
    Fiber& f = *g_cur;
    f.bar_pred = pred;
    f.state = State::AtBarrier;
    if (++g_block.at_barrier == g_block.live) release_barrier();
    yield();
    return {f.bar_count, f.bar_total};
}

// A finished thread leaves the block: barriers and collectives stop waiting for it.
inline void retire(Fiber& f) {
    Block& b = g_block;
    f.state = State::Done;
    --b.live;
    Warp& w = b.warps[f.warp];
    w.live &= ~(1u << f.lane);
    unsigned pending = w.pending;
    while (pending) {  // each distinct mask the warp's waiting lanes use may now be complete
        const unsigned mask = b.fibers[f.warp * 32 + unsigned(__builtin_ctz(pending))].op_mask;
        for (unsigned g = pending; g; g &= g - 1) {
            const unsigned l = unsigned(__builtin_ctz(g));
            if (b.fibers[f.warp * 32 + l].op_mask == mask) pending &= ~(1u << l);
        }
        try_complete(f.warp, mask);
    }
    if (b.live && b.at_barrier == b.live) release_barrier();
}

inline void fiber_entry() {
    g_body(g_body_arg);
    retire(*g_cur);
    yield();  // never resumed
    std::abort();
}

inline void start_fiber(Fiber& f, unsigned i) {
#ifdef ORT_SIM_UCONTEXT
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = g_stacks.top(i) - (g_stacks.stride - g_stacks.guard);
    f.ctx.uc_stack.ss_size = g_stacks.stride - g_stacks.guard;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
#else
    // Frame popped by ort_sim_swap: six callee-saved registers, then the return address fiber_entry,
    // then a null fake return address that leaves rsp 8 mod 16 at entry, as a call would.
    void** sp = reinterpret_cast<void**>(g_stacks.top(i)) - 8;
    for (int r = 0; r < 6; ++r) sp[r] = nullptr;
    sp[6] = reinterpret_cast<void*>(&fiber_entry);
    sp[7] = nullptr;
    f.ctx = sp;
#endif
}

inline void describe_deadlock() {
    const Block& b = g_block;
    unsigned barrier = 0, warp = 0;
    const Fiber* example = nullptr;
    for (const Fiber& f : b.fibers) {
        barrier += f.state == State::AtBarrier;
        if (f.state == State::AtWarp) {
            ++warp;
            if (!example) example = &f;
        }
    }
    char detail[256] = "";
    if (example) {
        std::snprintf(detail, sizeof detail, "; e.g. thread (%u,%u,%u) waits in a warp collective with mask 0x%08x"
                      " whose other live lanes never arrive", example->tid.x, example->tid.y, example->tid.z,
                      example->op_mask);
    }
    std::snprintf(g_error, sizeof g_error,
                  "kernel %s: block (%u,%u,%u) deadlocked with %u threads in __syncthreads and %u in warp "
                  "collectives%s",
                  g_kernel_name.c_str(), g_block_idx.x, g_block_idx.y, g_block_idx.z, barrier, warp, detail);
    g_error_code = kLaunchFailed;
}

inline bool run_block(unsigned n) {
    Block& b = g_block;
    b.head = b.count = 0;
    b.live = n;
    b.at_barrier = 0;
    const unsigned warps = (n + 31) / 32;
    for (unsigned w = 0; w < warps; ++w) {
        const unsigned lanes = n - w * 32 >= 32 ? 32 : n - w * 32;
        b.warps[w] = Warp{lanes == 32 ? ~0u : (1u << lanes) - 1, 0, 0, false};
    }
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = b.fibers[i];
        f.tid = uint3{i % g_block_dim.x, i / g_block_dim.x % g_block_dim.y, i / (g_block_dim.x * g_block_dim.y)};
        f.lane = i % 32;
        f.warp = i / 32;
        start_fiber(f, i);
        b.push(i);
    }
    while (b.count) {  // fibers hand over among themselves; this returns when none is ready
        g_cur = &b.fibers[b.pop()];
        g_cur->state = State::Running;
        switch_context(&b.sched, &g_cur->ctx);
    }
    g_cur = nullptr;
    if (b.live) {
        describe_deadlock();
        return false;
    }
    return true;
}

struct LaunchConfig {
    dim3 grid, block;
    size_t shared;
};

inline std::mutex g_launch_mutex;

// Block order: row-major like one SM, or (seed != 0) a permutation of the linear block index, so a kernel
// that assumes blocks run in order (a later block reading what an earlier one wrote) shows the bug here too.
inline unsigned long long g_block_shuffle_seed = 0;

struct BlockOrder {
    unsigned long long count, mask = 0, mul = 1, add = 0, cursor = 0;
    BlockOrder(unsigned long long n, unsigned long long seed) : count(n) {
        if (!seed || n < 2) return;
        while (mask < n - 1) mask = mask << 1 | 1;
        unsigned long long z = seed;  // splitmix64 draws the odd multiplier and the offset of an affine bijection
        auto draw = [&z] {
            unsigned long long r = z += 0x9e3779b97f4a7c15ull;
            r = (r ^ (r >> 30)) * 0xbf58476d1ce4e5b9ull;
            r = (r ^ (r >> 27)) * 0x94d049bb133111ebull;
            return r ^ (r >> 31);
        };
        mul = (draw() & mask) | 1;
        add = draw() & mask;
    }
    // The next block: walks the bijection of [0, 2^k) and skips the values past the grid.
    unsigned long long next() {
        if (!mask) return cursor++;
        for (;;) {
            const unsigned long long v = (cursor++ * mul + add) & mask;
            if (v < count) return v;
        }
    }
};

inline int run_grid(const char* name, const LaunchConfig& cfg, void (*body)(void*), void* arg) {
    std::lock_guard<std::mutex> lock(g_launch_mutex);
    g_kernel_name = name;
    g_error[0] = '\0';
    const dim3 g = cfg.grid, k = cfg.block;
    const unsigned long long threads = 1ull * k.x * k.y * k.z;
    if (!g.x || !g.y || !g.z || !threads || k.x > 1024 || k.y > 1024 || k.z > 64 || threads > kMaxThreads ||
        g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535 || cfg.shared > kMaxDynamicShared) {
        std::snprintf(g_error, sizeof g_error,
                      "kernel %s: invalid launch grid (%u,%u,%u) block (%u,%u,%u) shared %zu bytes", name, g.x, g.y,
                      g.z, k.x, k.y, k.z, cfg.shared);
        return kInvalidValue;
    }
    const unsigned n = unsigned(threads);
    if (!ensure_stacks(n) || !place_dynamic_shared(cfg.shared)) {
        std::snprintf(g_error, sizeof g_error, "kernel %s: cannot map fiber stacks or shared memory", name);
        return kOutOfMemory;
    }
    Block& b = g_block;  // sized to exactly this block: barrier bookkeeping iterates all its threads
    b.fibers.resize(n);
    b.ready.resize(n);
    b.warps.resize((n + 31) / 32);
    g_grid_dim = g;
    g_block_dim = k;
    g_body = body;
    g_body_arg = arg;
    g_error_code = kSuccess;
    FaultGuard guard;
    if (sigsetjmp(g_escape, 1) == 0) {
        const unsigned long long blocks = 1ull * g.x * g.y * g.z;
        BlockOrder order(blocks, g_block_shuffle_seed);
        for (unsigned long long i = 0; i < blocks; ++i) {
            const unsigned long long linear = order.next();
            g_block_idx = uint3{unsigned(linear % g.x), unsigned(linear / g.x % g.y), unsigned(linear / g.x / g.y)};
            if (!run_block(n)) break;
        }
    }
    g_cur = nullptr;
    std::fflush(stdout);  // device printf output appears with the launch that wrote it
    return g_error_code;
}

// ---- kernel registry -----------------------------------------------------------------------------------
struct Kernel {
    std::string name;
    int (*launch)(const char*, const LaunchConfig&, void**);
    std::string signature;
    unsigned max_threads;  // from __launch_bounds__, 0 when it has none
};

inline std::vector<Kernel>& registry() {
    static std::vector<Kernel> kernels;
    return kernels;
}

// One parameter's kind and size, e.g. "p8" pointer, "i4" signed, "u8" unsigned, "f4" float, "s24" other.
template <typename T>
std::string param_code() {
    char kind = 's';
    if (std::is_pointer_v<T>) kind = 'p';
    else if (std::is_floating_point_v<T>) kind = 'f';
    else if (std::is_integral_v<T>) kind = std::is_signed_v<T> ? 'i' : 'u';
    return kind + std::to_string(sizeof(T));
}

template <typename T>
T load_param(void* src) {
    static_assert(std::is_trivially_copyable_v<T>, "kernel parameters are copied bytewise, as on a GPU");
    T value;
    std::memcpy(static_cast<void*>(&value), src, sizeof(T));
    return value;
}

template <auto Fn, typename F = decltype(Fn)>
struct KernelTraits;

template <auto Fn, typename... A>
struct KernelTraits<Fn, void (*)(A...)> {
    using Params = std::tuple<std::decay_t<A>...>;

    template <size_t... I>
    static Params load(void** args, std::index_sequence<I...>) {
        return Params{load_param<std::decay_t<A>>(args[I])...};
    }
    static void body(void* params) { std::apply(Fn, *static_cast<Params*>(params)); }
    static int launch(const char* name, const LaunchConfig& cfg, void** args) {
        Params params = load(args, std::index_sequence_for<A...>{});
        return run_grid(name, cfg, &body, &params);
    }
    static std::string signature() {
        std::string out;
        ((out += (out.empty() ? "" : ","), out += param_code<std::decay_t<A>>()), ...);
        return out;
    }
};

struct Registrar {
    template <typename Traits>
    Registrar(const char* name, Traits, unsigned max_threads) {
        registry().push_back(Kernel{name, &Traits::launch, Traits::signature(), max_threads});
    }
};

inline const Kernel* find_kernel(const char* name) {
    for (const Kernel& k : registry()) {
        if (k.name == name) return &k;
    }
    return nullptr;
}

}  // namespace ort_sim

#define ORT_SIM_REGISTER(name, max_threads) \
    static ::ort_sim::Registrar ort_sim_registrar_##name(#name, ::ort_sim::KernelTraits<&name>{}, max_threads);

// ---- barriers, warp collectives, fences -------------------------------------------------------------
__forceinline__ void __syncthreads() { ::ort_sim::block_barrier(0); }
__forceinline__ int __syncthreads_count(int pred) { return ::ort_sim::block_barrier(pred).first; }
__forceinline__ int __syncthreads_and(int pred) {
    const auto tally = ::ort_sim::block_barrier(pred);
    return tally.first == tally.second;
}
__forceinline__ int __syncthreads_or(int pred) { return ::ort_sim::block_barrier(pred).first != 0; }
__forceinline__ void __syncwarp(unsigned mask = 0xffffffffu) {
    ::ort_sim::warp_collective(::ort_sim::WarpOp::Sync, mask, 0);
}
__forceinline__ void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__forceinline__ void __nanosleep(unsigned) {}
__forceinline__ unsigned __activemask() { return ::ort_sim::g_block.warps[::ort_sim::g_cur->warp].live; }
[[noreturn]] inline void __trap() {
    char where[128];
    ::ort_sim::describe_thread(where, sizeof where);
    char message[256];
    std::snprintf(message, sizeof message, "kernel %s: __trap() in %s", ::ort_sim::g_kernel_name.c_str(), where);
    ::ort_sim::fail(::ort_sim::kLaunchFailed, message);
}
namespace ort_sim {
[[noreturn]] inline void assert_failed(const char* expression, const char* file, int line) {
    char where[128];
    describe_thread(where, sizeof where);
    char message[512];
    std::snprintf(message, sizeof message, "kernel %s: assertion `%s` failed at %s:%d in %s", g_kernel_name.c_str(),
                  expression, file, line, where);
    fail(kAssert, message);
}
}  // namespace ort_sim

// A failed device assert ends the launch with CUDA_ERROR_ASSERT, as on a GPU, instead of aborting the process.
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : ::ort_sim::assert_failed(#e, __FILE__, __LINE__))
#endif

__forceinline__ long long clock64() {
    static long long ticks = 0;
    return ++ticks;
}

namespace ort_sim {
template <typename T>
uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "warp shuffles move at most 64 bits");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}
template <typename T>
T from_bits(uint64_t bits) {
    T v;
    std::memcpy(static_cast<void*>(&v), &bits, sizeof(T));
    return v;
}
}  // namespace ort_sim

template <typename T>
__forceinline__ T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    using namespace ::ort_sim;
    return from_bits<T>(warp_collective(WarpOp::ShflIdx, mask, to_bits(var), src_lane, width));
}
template <typename T>
__forceinline__ T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    using namespace ::ort_sim;
    return from_bits<T>(warp_collective(WarpOp::ShflUp, mask, to_bits(var), int(delta), width));
}
template <typename T>
__forceinline__ T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    using namespace ::ort_sim;
    return from_bits<T>(warp_collective(WarpOp::ShflDown, mask, to_bits(var), int(delta), width));
}
template <typename T>
__forceinline__ T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    using namespace ::ort_sim;
    return from_bits<T>(warp_collective(WarpOp::ShflXor, mask, to_bits(var), lane_mask, width));
}
__forceinline__ unsigned __ballot_sync(unsigned mask, int pred) {
    return unsigned(::ort_sim::warp_collective(::ort_sim::WarpOp::Ballot, mask, pred != 0));
}
__forceinline__ int __any_sync(unsigned mask, int pred) {
    return int(::ort_sim::warp_collective(::ort_sim::WarpOp::Any, mask, pred != 0));
}
__forceinline__ int __all_sync(unsigned mask, int pred) {
    return int(::ort_sim::warp_collective(::ort_sim::WarpOp::All, mask, pred != 0));
}
#define ORT_SIM_WARP_REDUCE(fn, op)                                                                        \
    __forceinline__ unsigned fn(unsigned mask, unsigned v) {                                              \
        return unsigned(::ort_sim::warp_collective(::ort_sim::WarpOp::op, mask, v, 0, 32, false));       \
    }                                                                                                     \
    __forceinline__ int fn(unsigned mask, int v) {                                                        \
        return int(::ort_sim::warp_collective(::ort_sim::WarpOp::op, mask, uint32_t(v), 0, 32, true));   \
    }
ORT_SIM_WARP_REDUCE(__reduce_add_sync, ReduceAdd)
ORT_SIM_WARP_REDUCE(__reduce_min_sync, ReduceMin)
ORT_SIM_WARP_REDUCE(__reduce_max_sync, ReduceMax)
ORT_SIM_WARP_REDUCE(__reduce_and_sync, ReduceAnd)
ORT_SIM_WARP_REDUCE(__reduce_or_sync, ReduceOr)
ORT_SIM_WARP_REDUCE(__reduce_xor_sync, ReduceXor)

// ---- atomics: fibers never switch inside these, so plain read-modify-write is atomic -----------------------
#define ORT_SIM_ATOMIC(fn, T, update)                                                                      \
    __forceinline__ T fn(T* address, T val) {                                                             \
        T old = *address;                                                                                 \
        *address = (update);                                                                              \
        return old;                                                                                       \
    }
ORT_SIM_ATOMIC(atomicAdd, int, old + val)
ORT_SIM_ATOMIC(atomicAdd, unsigned int, old + val)
ORT_SIM_ATOMIC(atomicAdd, unsigned long long, old + val)
ORT_SIM_ATOMIC(atomicAdd, float, old + val)
ORT_SIM_ATOMIC(atomicAdd, double, old + val)
ORT_SIM_ATOMIC(atomicSub, int, old - val)
ORT_SIM_ATOMIC(atomicSub, unsigned int, old - val)
ORT_SIM_ATOMIC(atomicExch, int, val)
ORT_SIM_ATOMIC(atomicExch, unsigned int, val)
ORT_SIM_ATOMIC(atomicExch, unsigned long long, val)
ORT_SIM_ATOMIC(atomicExch, float, val)
ORT_SIM_ATOMIC(atomicMax, int, old > val ? old : val)
ORT_SIM_ATOMIC(atomicMax, unsigned int, old > val ? old : val)
ORT_SIM_ATOMIC(atomicMax, long long, old > val ? old : val)
ORT_SIM_ATOMIC(atomicMax, unsigned long long, old > val ? old : val)
ORT_SIM_ATOMIC(atomicMin, int, old < val ? old : val)
ORT_SIM_ATOMIC(atomicMin, unsigned int, old < val ? old : val)
ORT_SIM_ATOMIC(atomicMin, long long, old < val ? old : val)
ORT_SIM_ATOMIC(atomicMin, unsigned long long, old < val ? old : val)
ORT_SIM_ATOMIC(atomicAnd, int, old & val)
ORT_SIM_ATOMIC(atomicAnd, unsigned int, old & val)
ORT_SIM_ATOMIC(atomicAnd, unsigned long long, old & val)
ORT_SIM_ATOMIC(atomicOr, int, old | val)
ORT_SIM_ATOMIC(atomicOr, unsigned int, old | val)
ORT_SIM_ATOMIC(atomicOr, unsigned long long, old | val)
ORT_SIM_ATOMIC(atomicXor, int, old ^ val)
ORT_SIM_ATOMIC(atomicXor, unsigned int, old ^ val)
ORT_SIM_ATOMIC(atomicXor, unsigned long long, old ^ val)
ORT_SIM_ATOMIC(atomicInc, unsigned int, old >= val ? 0u : old + 1)
ORT_SIM_ATOMIC(atomicDec, unsigned int, (old == 0 || old > val) ? val : old - 1)
#define ORT_SIM_ATOMIC_CAS(T)                                                                              \
    __forceinline__ T atomicCAS(T* address, T compare, T val) {                                           \
        T old = *address;                                                                                 \
        if (old == compare) *address = val;                                                               \
        return old;                                                                                       \
    }
ORT_SIM_ATOMIC_CAS(int)
ORT_SIM_ATOMIC_CAS(unsigned int)
ORT_SIM_ATOMIC_CAS(unsigned long long)
ORT_SIM_ATOMIC_CAS(unsigned short)

// ---- bit reinterpretation and integer intrinsics ---------------------------------------------------------
__forceinline__ int __float_as_int(float x) { return ::ort_sim::from_bits<int>(::ort_sim::to_bits(x)); }
__forceinline__ unsigned __float_as_uint(float x) { return ::ort_sim::from_bits<unsigned>(::ort_sim::to_bits(x)); }
__forceinline__ float __int_as_float(int x) { return ::ort_sim::from_bits<float>(::ort_sim::to_bits(x)); }
__forceinline__ float __uint_as_float(unsigned x) { return ::ort_sim::from_bits<float>(::ort_sim::to_bits(x)); }
__forceinline__ long long __double_as_longlong(double x) {
    return ::ort_sim::from_bits<long long>(::ort_sim::to_bits(x));
}
__forceinline__ double __longlong_as_double(long long x) { return ::ort_sim::from_bits<double>(::ort_sim::to_bits(x)); }
__forceinline__ int __popc(unsigned x) { return __builtin_popcount(x); }
__forceinline__ int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
__forceinline__ int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
__forceinline__ int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
__forceinline__ int __ffs(int x) { return __builtin_ffs(x); }
__forceinline__ int __ffsll(long long x) { return __builtin_ffsll(x); }
__forceinline__ unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    return __builtin_bswap32(x);
}
__forceinline__ int __mul24(int a, int b) { return a * b; }
__forceinline__ unsigned __umul24(unsigned a, unsigned b) { return a * b; }
__forceinline__ int __mulhi(int a, int b) { return int((long long)a * b >> 32); }
__forceinline__ unsigned __umulhi(unsigned a, unsigned b) { return unsigned((unsigned long long)a * b >> 32); }
__forceinline__ unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    __extension__ typedef unsigned __int128 u128;
    return (unsigned long long)((u128)a * b >> 64);
}
template <typename T>
__forceinline__ T __ldg(const T* p) { return *p; }

// CUDA's integer min/max overloads (mixed signedness follows the usual arithmetic conversions).
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
__forceinline__ std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    return C(a) < C(b) ? C(a) : C(b);
}
template <typename A, typename B, typename = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
__forceinline__ std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    return C(a) > C(b) ? C(a) : C(b);
}

// ---- float intrinsics (the fast approximations are computed exactly here) --------------------------------
__forceinline__ float rsqrtf(float x) { return 1.0f / sqrtf(x); }
__forceinline__ double rsqrt(double x) { return 1.0 / sqrt(x); }
__forceinline__ float __expf(float x) { return expf(x); }
__forceinline__ float __exp10f(float x) { return exp10f(x); }
__forceinline__ float __logf(float x) { return logf(x); }
__forceinline__ float __log2f(float x) { return log2f(x); }
__forceinline__ float __log10f(float x) { return log10f(x); }
__forceinline__ float __sinf(float x) { return sinf(x); }
__forceinline__ float __cosf(float x) { return cosf(x); }
__forceinline__ float __tanf(float x) { return tanf(x); }
__forceinline__ float __powf(float x, float y) { return powf(x, y); }
__forceinline__ float __fdividef(float x, float y) { return x / y; }
__forceinline__ float __frcp_rn(float x) { return 1.0f / x; }
__forceinline__ float __fsqrt_rn(float x) { return sqrtf(x); }
__forceinline__ float __fadd_rn(float x, float y) { return x + y; }
__forceinline__ float __fsub_rn(float x, float y) { return x - y; }
__forceinline__ float __fmul_rn(float x, float y) { return x * y; }
__forceinline__ float __fdiv_rn(float x, float y) { return x / y; }
__forceinline__ float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
__forceinline__ float __saturatef(float x) { return x != x ? 0.0f : fminf(fmaxf(x, 0.0f), 1.0f); }
__forceinline__ void __sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
__forceinline__ float __int2float_rn(int x) { return float(x); }
__forceinline__ int __float2int_rn(float x) { return int(nearbyintf(x)); }
__forceinline__ int __float2int_rz(float x) { return int(x); }
__forceinline__ int __float2int_rd(float x) { return int(floorf(x)); }
__forceinline__ int __float2int_ru(float x) { return int(ceilf(x)); }
__forceinline__ float __ll2float_rn(long long x) { return float(x); }
__forceinline__ float __uint2float_rn(unsigned x) { return float(x); }
__forceinline__ unsigned __float2uint_rn(float x) { return unsigned(nearbyintf(x)); }
__forceinline__ unsigned __float2uint_rz(float x) { return unsigned(x); }
__forceinline__ long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
__forceinline__ long long __float2ll_rz(float x) { return (long long)x; }
__forceinline__ float __double2float_rn(double x) { return float(x); }
__forceinline__ double __int2double_rn(int x) { return double(x); }

// ---- __half and __nv_bfloat16: storage types whose arithmetic is done in float ---------------------------
namespace ort_sim {
// float -> binary16 with round-to-nearest-even, subnormals and overflow to infinity; every NaN becomes
// 0x7fff, the canonical NaN CUDA's conversions produce.
inline uint16_t float_to_half_bits(float value) {
    const uint32_t x = from_bits<uint32_t>(to_bits(value));
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds past 65504
    if (a < 0x38800000u) {                                    // below 2^-14: subnormal or zero
        if (a <= 0x33000000u) return uint16_t(sign);          // <= 2^-25 rounds (to even) to zero
        const uint32_t shift = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
        return uint16_t(sign | q);
    }
    uint32_t h = (a - 0x38000000u) >> 13;  // rebias the exponent, keep 10 mantissa bits
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is still correct
    return uint16_t(sign | h);
}
inline uint16_t float_to_half_bits_rz(float value) {
    const uint32_t x = from_bits<uint32_t>(to_bits(value));
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7fffu;
    if (a == 0x7f800000u) return uint16_t(sign | 0x7c00u);
    if (a >= 0x47800000u) return uint16_t(sign | 0x7bffu);
    if (a < 0x33800000u) return uint16_t(sign);
    if (a < 0x38800000u) return uint16_t(sign | (((a & 0x7fffffu) | 0x800000u) >> (126u - (a >> 23))));
    return uint16_t(sign | ((a - 0x38000000u) >> 13));
}
inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        if (m == 0) {
            x = sign;
        } else {  // subnormal: normalize the mantissa
            e = 113;
            while (!(m & 0x400u)) { m <<= 1; --e; }
            x = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) {
        x = sign | 0x7f800000u | (m << 13);
    } else {
        x = sign | ((e + 112u) << 23) | (m << 13);
    }
    return from_bits<float>(x);
}
inline uint16_t float_to_bf16_bits(float value) {
    const uint32_t x = from_bits<uint32_t>(to_bits(value));
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // CUDA's canonical NaN
    return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(uint16_t b) { return from_bits<float>(uint32_t(b) << 16); }
}  // namespace ort_sim

struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

#define ORT_SIM_HALF_TYPE(T, RAW, TO_BITS, TO_FLOAT)                                                       \
    struct __align__(2) T {                                                                               \
        unsigned short __x;                                                                               \
        T() = default;                                                                                    \
        constexpr T(RAW r) : __x(r.x) {}                                                                  \
        T(float f) : __x(::ort_sim::TO_BITS(f)) {}                                                        \
        T(double f) : __x(::ort_sim::TO_BITS(float(f))) {}                                                \
        T(int v) : __x(::ort_sim::TO_BITS(float(v))) {}                                                   \
        T(unsigned v) : __x(::ort_sim::TO_BITS(float(v))) {}                                              \
        T(long v) : __x(::ort_sim::TO_BITS(float(v))) {}                                                  \
        T(unsigned long v) : __x(::ort_sim::TO_BITS(float(v))) {}                                         \
        T(long long v) : __x(::ort_sim::TO_BITS(float(v))) {}                                             \
        T(unsigned long long v) : __x(::ort_sim::TO_BITS(float(v))) {}                                    \
        T(short v) : __x(::ort_sim::TO_BITS(float(v))) {}                                                 \
        T(unsigned short v) : __x(::ort_sim::TO_BITS(float(v))) {}                                        \
        operator float() const { return ::ort_sim::TO_FLOAT(__x); }                                       \
        operator RAW() const { return RAW{__x}; }                                                         \
        T& operator=(float f) { __x = ::ort_sim::TO_BITS(f); return *this; }                              \
        T& operator+=(T o) { return *this = float(*this) + float(o); }                                    \
        T& operator-=(T o) { return *this = float(*this) - float(o); }                                    \
        T& operator*=(T o) { return *this = float(*this) * float(o); }                                    \
        T& operator/=(T o) { return *this = float(*this) / float(o); }                                    \
    };                                                                                                    \
    __forceinline__ T operator+(T a, T b) { return T(float(a) + float(b)); }                              \
    __forceinline__ T operator-(T a, T b) { return T(float(a) - float(b)); }                              \
    __forceinline__ T operator*(T a, T b) { return T(float(a) * float(b)); }                              \
    __forceinline__ T operator/(T a, T b) { return T(float(a) / float(b)); }                              \
    __forceinline__ T operator-(T a) { T r; r.__x = uint16_t(a.__x ^ 0x8000u); return r; }                \
    __forceinline__ T operator+(T a) { return a; }                                                        \
    __forceinline__ bool operator==(T a, T b) { return float(a) == float(b); }                            \
    __forceinline__ bool operator!=(T a, T b) { return float(a) != float(b); }                            \
    __forceinline__ bool operator<(T a, T b) { return float(a) < float(b); }                              \
    __forceinline__ bool operator<=(T a, T b) { return float(a) <= float(b); }                            \
    __forceinline__ bool operator>(T a, T b) { return float(a) > float(b); }                              \
    __forceinline__ bool operator>=(T a, T b) { return float(a) >= float(b); }                            \
    __forceinline__ T __hadd(T a, T b) { return a + b; }                                                  \
    __forceinline__ T __hsub(T a, T b) { return a - b; }                                                  \
    __forceinline__ T __hmul(T a, T b) { return a * b; }                                                  \
    __forceinline__ T __hdiv(T a, T b) { return a / b; }                                                  \
    __forceinline__ T __hneg(T a) { return -a; }                                                          \
    __forceinline__ T __habs(T a) { T r; r.__x = uint16_t(a.__x & 0x7fffu); return r; }                   \
    __forceinline__ T __hfma(T a, T b, T c) { return T(fmaf(float(a), float(b), float(c))); }             \
    __forceinline__ T __hmax(T a, T b) { return T(fmaxf(float(a), float(b))); }                          \
    __forceinline__ T __hmin(T a, T b) { return T(fminf(float(a), float(b))); }                          \
    __forceinline__ bool __heq(T a, T b) { return a == b; }                                               \
    __forceinline__ bool __hne(T a, T b) { return a != b; }                                               \
    __forceinline__ bool __hlt(T a, T b) { return a < b; }                                                \
    __forceinline__ bool __hle(T a, T b) { return a <= b; }                                               \
    __forceinline__ bool __hgt(T a, T b) { return a > b; }                                                \
    __forceinline__ bool __hge(T a, T b) { return a >= b; }                                               \
    __forceinline__ bool __hisnan(T a) { return float(a) != float(a); }                                   \
    __forceinline__ int __hisinf(T a) { float f = float(a); return std::isinf(f) ? (f < 0 ? -1 : 1) : 0; } \
    __forceinline__ T hexp(T a) { return T(expf(float(a))); }                                             \
    __forceinline__ T hlog(T a) { return T(logf(float(a))); }                                             \
    __forceinline__ T hsqrt(T a) { return T(sqrtf(float(a))); }                                           \
    __forceinline__ T hrsqrt(T a) { return T(1.0f / sqrtf(float(a))); }                                   \
    __forceinline__ T hrcp(T a) { return T(1.0f / float(a)); }                                            \
    __forceinline__ T htanh(T a) { return T(tanhf(float(a))); }                                           \
    __forceinline__ T hfloor(T a) { return T(floorf(float(a))); }                                         \
    __forceinline__ T hceil(T a) { return T(ceilf(float(a))); }                                           \
    __forceinline__ T atomicAdd(T* address, T val) { T old = *address; *address = old + val; return old; }

ORT_SIM_HALF_TYPE(__half, __half_raw, float_to_half_bits, half_bits_to_float)
ORT_SIM_HALF_TYPE(__nv_bfloat16, __nv_bfloat16_raw, float_to_bf16_bits, bf16_bits_to_float)
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

__forceinline__ float __half2float(__half h) { return float(h); }
__forceinline__ __half __float2half(float f) { return __half(f); }
__forceinline__ __half __float2half_rn(float f) { return __half(f); }
__forceinline__ __half __float2half_rz(float f) { return __half(__half_raw{::ort_sim::float_to_half_bits_rz(f)}); }
__forceinline__ __half __double2half(double f) { return __half(float(f)); }
__forceinline__ __half __int2half_rn(int v) { return __half(float(v)); }
__forceinline__ int __half2int_rz(__half h) { return int(float(h)); }
__forceinline__ int __half2int_rn(__half h) { return int(nearbyintf(float(h))); }
__forceinline__ unsigned short __half_as_ushort(__half h) { return h.__x; }
__forceinline__ short __half_as_short(__half h) { return short(h.__x); }
__forceinline__ __half __ushort_as_half(unsigned short v) { return __half(__half_raw{v}); }
__forceinline__ __half __short_as_half(short v) { return __half(__half_raw{(unsigned short)v}); }
__forceinline__ float __bfloat162float(__nv_bfloat16 b) { return float(b); }
__forceinline__ __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
__forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
__forceinline__ __nv_bfloat16 __float2bfloat16_rz(float f) {
    return __nv_bfloat16(__nv_bfloat16_raw{uint16_t(f != f ? 0x7fffu : __float_as_uint(f) >> 16)});
}
__forceinline__ __nv_bfloat16 __double2bfloat16(double f) { return __nv_bfloat16(float(f)); }
__forceinline__ __nv_bfloat16 __int2bfloat16_rn(int v) { return __nv_bfloat16(float(v)); }
__forceinline__ int __bfloat162int_rz(__nv_bfloat16 b) { return int(float(b)); }
__forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
__forceinline__ short __bfloat16_as_short(__nv_bfloat16 b) { return short(b.__x); }
__forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16(__nv_bfloat16_raw{v}); }
__forceinline__ __nv_bfloat16 __short_as_bfloat16(short v) {
    return __nv_bfloat16(__nv_bfloat16_raw{(unsigned short)v});
}

// Pairs, for vectorized loads and stores.
#define ORT_SIM_HALF2_TYPE(T2, T, PREFIX, MAKE)                                                                \
    struct __align__(4) T2 {                                                                              \
        T x, y;                                                                                           \
    };                                                                                                    \
    __forceinline__ T2 operator+(T2 a, T2 b) { return T2{a.x + b.x, a.y + b.y}; }                         \
    __forceinline__ T2 operator-(T2 a, T2 b) { return T2{a.x - b.x, a.y - b.y}; }                         \
    __forceinline__ T2 operator*(T2 a, T2 b) { return T2{a.x * b.x, a.y * b.y}; }                         \
    __forceinline__ T2 __hadd2(T2 a, T2 b) { return a + b; }                                              \
    __forceinline__ T2 __hsub2(T2 a, T2 b) { return a - b; }                                              \
    __forceinline__ T2 __hmul2(T2 a, T2 b) { return a * b; }                                              \
    __forceinline__ T2 __hfma2(T2 a, T2 b, T2 c) { return T2{__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)}; } \
    __forceinline__ T2 __hmax2(T2 a, T2 b) { return T2{__hmax(a.x, b.x), __hmax(a.y, b.y)}; }             \
    __forceinline__ T2 __hmin2(T2 a, T2 b) { return T2{__hmin(a.x, b.x), __hmin(a.y, b.y)}; }             \
    __forceinline__ T2 __halves2##PREFIX##2(T a, T b) { return T2{a, b}; }                                \
    __forceinline__ T2 MAKE(T a, T b) { return T2{a, b}; }                                                  \
    __forceinline__ T __low2##PREFIX(T2 v) { return v.x; }                                                \
    __forceinline__ T __high2##PREFIX(T2 v) { return v.y; }                                               \
    __forceinline__ float __low2float(T2 v) { return float(v.x); }                                        \
    __forceinline__ float __high2float(T2 v) { return float(v.y); }

ORT_SIM_HALF2_TYPE(__half2, __half, half, make_half2)
ORT_SIM_HALF2_TYPE(__nv_bfloat162, __nv_bfloat16, bfloat16, make_bfloat162)
typedef __half2 half2;
typedef __nv_bfloat162 nv_bfloat162;
__forceinline__ float2 __half22float2(__half2 v) { return float2{float(v.x), float(v.y)}; }
__forceinline__ __half2 __float22half2_rn(float2 v) { return __half2{__half(v.x), __half(v.y)}; }
__forceinline__ __half2 __floats2half2_rn(float a, float b) { return __half2{__half(a), __half(b)}; }
__forceinline__ __half2 __float2half2_rn(float a) { return __half2{__half(a), __half(a)}; }
__forceinline__ float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{float(v.x), float(v.y)}; }
__forceinline__ __nv_bfloat162 __float22bfloat162_rn(float2 v) {
    return __nv_bfloat162{__nv_bfloat16(v.x), __nv_bfloat16(v.y)};
}
__forceinline__ __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)};
}
__forceinline__ __nv_bfloat162 __float2bfloat162_rn(float a) {
    return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(a)};
}

// ---- C ABI for sim/compiler.py ------------------------------------------------------------------------------
#define ORT_SIM_EXPORT extern "C" __attribute__((visibility("default")))

// 0, or a CUresult value: 500 (CUDA_ERROR_NOT_FOUND) for an unknown name, 1 for a bad configuration,
// 701 for more threads than the kernel's __launch_bounds__, 700/719 for a faulting, trapping or
// deadlocked kernel (ort_sim_last_error() says which).
ORT_SIM_EXPORT int ort_sim_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                  unsigned bz, size_t shared, void** args) {
    using namespace ::ort_sim;
    const Kernel* k = find_kernel(name);
    if (!k) {
        std::snprintf(g_error, sizeof g_error, "no kernel named %s in this module", name);
        return kNotFound;
    }
    if (k->max_threads && 1ull * bx * by * bz > k->max_threads) {
        std::snprintf(g_error, sizeof g_error, "kernel %s: block of %llu threads exceeds its __launch_bounds__ (%u)",
                      name, 1ull * bx * by * bz, k->max_threads);
        return kLaunchOutOfResources;
    }
    return k->launch(name, LaunchConfig{dim3(gx, gy, gz), dim3(bx, by, bz), shared}, args);
}

// The module's kernel names, one per line.
ORT_SIM_EXPORT const char* ort_sim_kernel_names() {
    static std::string names;
    names.clear();
    for (const ::ort_sim::Kernel& k : ::ort_sim::registry()) names += k.name + "\n";
    return names.c_str();
}

// Comma-separated parameter codes of kernel `name` (see param_code), or null when there is none.
ORT_SIM_EXPORT const char* ort_sim_kernel_signature(const char* name) {
    const ::ort_sim::Kernel* k = ::ort_sim::find_kernel(name);
    return k ? k->signature.c_str() : nullptr;
}

// The kernel's __launch_bounds__ thread limit, 0 when it declares none (or is unknown).
ORT_SIM_EXPORT int ort_sim_kernel_max_threads(const char* name) {
    const ::ort_sim::Kernel* k = ::ort_sim::find_kernel(name);
    return k ? int(k->max_threads) : 0;
}

ORT_SIM_EXPORT const char* ort_sim_last_error() { return ::ort_sim::g_error; }

// Seed of the block order of later launches in this module; 0 runs blocks in row-major order.
ORT_SIM_EXPORT void ort_sim_set_block_shuffle(unsigned long long seed) { ::ort_sim::g_block_shuffle_seed = seed; }
