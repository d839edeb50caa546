"""Way (a) of the persistent-step premise with a copy engine (issue #59): the MLP chain of
benchmarks/persistent_mlp.py as one persistent Gluon kernel whose weight tiles stream into a
ring of shared-memory pages by cp.async, NBUF - 1 pages ahead of the compute, straight across
operator boundaries.

Plain Triton can hold the next task's tile in registers (persistent_mlp.py's `persist_sw0`) but
cannot keep asynchronous copies in flight across a counter wait: its pipeliner stops at the
loop. Weights do not depend on activations, so a program can issue the copies of its whole task
stream (gate_up tiles of layer l, then down tiles of layer l, then layer l + 1's ...) as far
ahead as its ring holds, and only the compute waits for the counters. NBUF pages of 16 KB a
program, one program an SM: (NBUF - 1) x 16 KB x SMs in flight over the grid (11 pages on 132
SMs: 23 MB), against one tile a program for the register form.

A page is [BN_GU, 2, H] weights (H = the hidden size, a power of two), one warp per BN_GU
index, the gate/up pair inside each thread: segment (a, j) of a gate_up task is gate row (j = 0)
or up row (j = 1) BN_GU t + a, a whole row of H, so the row sums stay inside a warp. A down task
has BN_D rows of I, each over SPR = ceil(I / H) consecutive segments (segment 2 a + j: row
(2 a + j) // SPR, columns from ((2 a + j) % SPR) H, masked past I); its sums leave the warp once a
task. The down input is gathered once an operator into the same shape (it does not depend on
the task). Every cp.async and every read of a page go through the same layout; the compiler
puts a barrier around each page use, so a slot is reused only after the whole program has read
it.

The ring runs one item per task: before computing item s, issue item s + NBUF - 1 into the slot
item s - 1 used, then `wait_group(NBUF - 1)` (copies complete in issue order, so item s is in).
Past the program's last task the items are fully masked copies (they keep the group count
constant); the kernel drains the ring before it exits.

Ordering, stall injection, epochs and the timeout guard are persistent_mlp.py's (counter q + 1
after operator q, targets (epoch + 1) x grid, nothing reset between chains), through the same
kernels/_persistent.py helpers: they make no tensors, so a Gluon kernel can call them. GPU only
(Gluon has no interpreter); persistent_mlp.py runs it as its `ring_*` variants beside the
others.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as ac
from triton.experimental.gluon.language.nvidia.ampere import mbarrier

# cp.async of a pointer tensor into shared memory: async_copy_global_to_shared up to Triton 3.6
# (the device's), async_load after it was renamed (3.9, this repo's CI)
_cp_async = getattr(ac, "async_load", None) or ac.async_copy_global_to_shared
# a barrier over the calling warps: thread_barrier up to Triton 3.6, barrier after it
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# the counter wait, count and stall of the Triton persistent kernels (kernels/_persistent.py):
# @triton.jit helpers that make no tensors of their own, so a Gluon kernel can call them
from persistent_common import signal, stall, wait_counter  # noqa: E402


# the ring's pages: no swizzle, every copy and read through the same [BN_GU, 2, H] blocked view
_SH = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))

# ------------------------------------------------------------------------------------------
# the page stream
# ------------------------------------------------------------------------------------------

@gluon.jit
def _page(item, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg, cols,
          H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr):
    """Pointers [BN_GU, 2, H] and mask of this program's stream item `item`: layer item //
    n_mine, then its gate_up task (item % n_mine < n_gu) or down task."""
    SPR: gl.constexpr = (I + H - 1) // H
    l = item // n_mine
    r = item - l * n_mine
    lg = (layer0 + l).to(gl.int64)
    t_gu = pid + r * G
    t_d = pid + (r - n_gu) * G
    a = seg // 2
    j = seg - 2 * a
    row = j * I + t_gu * BN_GU + a                         # gate row, or up row (j = 1)
    p_gu = wgu_ptr + lg * (2 * I * H) + row.to(gl.int64) * H + cols
    rr = seg // SPR                                        # down: row of the task, its columns
    k = (seg - rr * SPR) * H + cols
    p_d = wd_ptr + lg * (H * I) + (t_d * BN_D + rr).to(gl.int64) * I + k
    is_gu = r < n_gu
    ptrs = gl.where(is_gu, p_gu, p_d)
    mask = (l < n_layers) & (is_gu | ((k < I) & (rr < BN_D)))
    return ptrs, mask


@gluon.jit
def _issue(ring, item, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg, cols,
           H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr,
           NBUF: gl.constexpr):
    """Stream item `item` into its ring slot: one cp.async group."""
    ptrs, mask = _page(item, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg, cols,
                       H, I, BN_GU, BN_D)
    _cp_async(ring.index(item % NBUF), ptrs, mask=mask)
    ac.commit_group()


@gluon.jit
def _next(ring, full, empty, s, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg,
          cols, H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr,
          NBUF: gl.constexpr, L3: gl.constexpr, WS: gl.constexpr):
    """Stream item s from its slot, fp32. WS False: issue item s + NBUF - 1 into the slot item
    s - 1 used, then wait until at most NBUF - 1 groups are in flight (copies complete in issue
    order, so item s is in). WS True: wait for the slot's fill, read it, release it."""
    slot = s % NBUF
    if WS:
        mbarrier.wait(full.index(slot), (s // NBUF) & 1)
        w = ring.index(slot).load(L3).to(gl.float32)
        _cta_barrier()                      # every compute warp has read the slot
        mbarrier.arrive(empty.index(slot))
    else:
        _issue(ring, s + NBUF - 1, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg,
               cols, H, I, BN_GU, BN_D, NBUF)
        ac.wait_group(NBUF - 1)
        w = ring.index(slot).load(L3).to(gl.float32)
    return w


@gluon.jit
def _consume(ring, full, empty, h_ptr, act_ptr, nw_ptr, wgu_ptr, wd_ptr, cnt_ptr, epoch_ptr,
             err_ptr, stamp_ptr, n_layers, layer0, G, eps, stall_op, stall_ns, timeout_ns,
             H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr,
             NBUF: gl.constexpr, STALL: gl.constexpr, WS: gl.constexpr):
    """The chain's compute on BN_GU warps. WS False: this program also streams its pages
    (cp.async groups, NBUF - 1 ahead); WS True: a producer partition streams them (_produce) and
    each page is taken on its slot's barriers."""
    # [BN_GU, 2, H]: warp a holds segments (a, 0) and (a, 1), each thread both at the same
    # columns, 16-byte vectors along H (num_warps = BN_GU)
    L3: gl.constexpr = gl.BlockedLayout([1, 2, 8], [1, 1, 32], [BN_GU, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)                          # [BN_GU, 2]
    LA: gl.constexpr = gl.SliceLayout(1, LS)                          # [BN_GU]
    LH: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, L3))      # [H]
    LR: gl.constexpr = gl.BlockedLayout([BN_GU, 2], [32, 1], [BN_GU, 1], [1, 0])  # every thread all
    SPR: gl.constexpr = (I + H - 1) // H
    T_GU: gl.constexpr = I // BN_GU
    T_D: gl.constexpr = H // BN_D
    pid = gl.program_id(0)
    base = gl.load(epoch_ptr + pid) + 1
    n_gu = (T_GU - pid + G - 1) // G
    n_d = (T_D - pid + G - 1) // G
    n_mine = n_gu + n_d
    a1 = gl.arange(0, BN_GU, layout=LA)
    j1 = gl.arange(0, 2, layout=gl.SliceLayout(0, LS))
    seg = gl.expand_dims(gl.expand_dims(a1, 1) * 2 + gl.expand_dims(j1, 0), 2)   # [BN_GU, 2, 1]
    hcols = gl.arange(0, H, layout=LH)
    cols = gl.expand_dims(gl.expand_dims(hcols, 0), 0)                           # [1, 1, H]
    jsel = gl.expand_dims(j1, 0)                                                 # [1, 2]
    d_rr = seg // SPR                                 # a down page's element: row, column
    d_k = (seg - d_rr * SPR) * H + cols
    d_ok = (d_k < I) & (d_rr < BN_D)
    # the down row of each segment, in LR
    rsel = (gl.expand_dims(gl.arange(0, BN_GU, layout=gl.SliceLayout(1, LR)), 1) * 2
            + gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, LR)), 0)) // SPR
    if not WS:      # the ring's first NBUF - 1 items, before anything else
        for i in gl.static_range(NBUF - 1):
            _issue(ring, i, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine, pid, G, seg, cols,
                   H, I, BN_GU, BN_D, NBUF)
    s = 0
    for l in range(n_layers):
        q = 2 * l
        # ---- gate_up: act = round(silu(Wg x) * (Wu x)), x = round(rms_norm(h) * (1 + w))
        nw = gl.load(nw_ptr + (layer0 + l) * H + hcols).to(gl.float32)
        if q > 0:
            wait_counter(cnt_ptr + q - 1, base * G, err_ptr, timeout_ns, 0)
        if STALL:
            if (q == stall_op) & (pid == 0):
                stall(stall_ns, stamp_ptr)
        hv = gl.load(h_ptr + hcols, cache_modifier=".cg")
        hf = hv.to(gl.float32)
        inv = gl.rsqrt(gl.sum(hf * hf, axis=0) / H + eps)
        x = gl.expand_dims(gl.expand_dims((hf * inv * (1.0 + nw)).to(hv.dtype).to(gl.float32),
                                          0), 0)
        for r in range(n_gu):
            w = _next(ring, full, empty, s, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine,
                      pid, G, seg, cols, H, I, BN_GU, BN_D, NBUF, L3, WS)
            y = gl.sum(w * x, axis=2)                                   # [BN_GU, 2]
            g = gl.sum(gl.where(jsel == 0, y, 0.0), axis=1)
            u = gl.sum(gl.where(jsel == 1, y, 0.0), axis=1)
            gl.store(act_ptr + (pid + r * G) * BN_GU + a1,
                     (g / (1.0 + gl.exp(-g)) * u).to(hv.dtype))
            s += 1
        signal(cnt_ptr + q, 1)
        # ---- down: h = round(h + Wd act)
        wait_counter(cnt_ptr + q, base * G, err_ptr, timeout_ns, 0)
        if STALL:
            if (q + 1 == stall_op) & (pid == 0):
                stall(stall_ns, stamp_ptr)
        xa = gl.load(act_ptr + d_k, mask=d_ok, other=0.0, cache_modifier=".cg").to(gl.float32)
        for r in range(n_d):
            w = _next(ring, full, empty, s, wgu_ptr, wd_ptr, layer0, n_layers, n_gu, n_mine,
                      pid, G, seg, cols, H, I, BN_GU, BN_D, NBUF, L3, WS)
            # segment sums inside the warps, then once to every thread (one exchange a task)
            ys = gl.convert_layout(gl.sum(gl.where(d_ok, w * xa, 0.0), axis=2), LR)
            hrow = h_ptr + (pid + r * G) * BN_D
            for rr in gl.static_range(BN_D):
                y = gl.sum(gl.sum(gl.where(rsel == rr, ys, 0.0), axis=1), axis=0)
                hr = gl.load(hrow + rr, cache_modifier=".cg").to(gl.float32)
                gl.store(hrow + rr, (hr + y).to(hv.dtype))
            s += 1
        signal(cnt_ptr + q + 1, 1)
    if not WS:
        ac.wait_group(0)
    gl.store(epoch_ptr + pid, base)


@gluon.jit
def _mlp_ring_kernel(h_ptr, act_ptr, nw_ptr, wgu_ptr, wd_ptr, cnt_ptr, epoch_ptr, err_ptr,
                     stamp_ptr, n_layers, layer0, G, eps, stall_op, stall_ns, timeout_ns,
                     H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr,
                     NBUF: gl.constexpr, STALL: gl.constexpr):
    """The ring streamed and computed in one instruction stream (num_warps = BN_GU)."""
    ring = gl.allocate_shared_memory(wgu_ptr.dtype.element_ty, [NBUF, BN_GU, 2, H], _SH)
    _consume(ring, ring, ring, h_ptr, act_ptr, nw_ptr, wgu_ptr, wd_ptr, cnt_ptr, epoch_ptr,
             err_ptr, stamp_ptr, n_layers, layer0, G, eps, stall_op, stall_ns, timeout_ns,
             H, I, BN_GU, BN_D, NBUF, STALL, False)


@gluon.jit
def _produce(ring, full, empty, wgu_ptr, wd_ptr, layer0, n_layers, G,
             H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr, BN_D: gl.constexpr,
             NBUF: gl.constexpr, PW: gl.constexpr):
    """The producer partition (PW warps): this program's pages in the consumer's order, each
    into its slot once the consumers released the slot's previous page, a [1, 2, H] slice (two
    segments) a batch of cp.async, completion counted on the slot's `full` barrier (every
    producer thread arrives once its own copies have landed). It never waits on a counter."""
    LP: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 1, 32], [1, 1, PW], [2, 1, 0])
    SPR: gl.constexpr = (I + H - 1) // H
    T_GU: gl.constexpr = I // BN_GU
    T_D: gl.constexpr = H // BN_D
    pid = gl.program_id(0)
    n_gu = (T_GU - pid + G - 1) // G
    n_mine = n_gu + (T_D - pid + G - 1) // G
    j = gl.expand_dims(gl.expand_dims(gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(
        2, LP))), 0), 2)                                                         # [1, 2, 1]
    cols = gl.expand_dims(gl.expand_dims(gl.arange(0, H, layout=gl.SliceLayout(0, gl.SliceLayout(
        0, LP))), 0), 0)                                                         # [1, 1, H]
    for s in range(n_layers * n_mine):
        slot = s % NBUF
        # page s - NBUF released (parity trick: a fresh barrier passes the first NBUF waits)
        mbarrier.wait(empty.index(slot), ((s // NBUF) & 1) ^ 1)
        l = s // n_mine
        r = s - l * n_mine
        lg = (layer0 + l).to(gl.int64)
        page = ring.index(slot)
        if r < n_gu:                # gate row (j = 0) and up row (j = 1) of output BN_GU t + a
            p_gu = wgu_ptr + lg * (2 * I * H) + ((pid + r * G) * BN_GU + j * I) * H + cols
            for a in gl.static_range(BN_GU):
                _cp_async(page.slice(a, 1), p_gu + a * H)
        else:                       # segment 2 a + j: down row (2 a + j) // SPR, masked past I
            p_d = wd_ptr + lg * (H * I) + (pid + (r - n_gu) * G) * BN_D * I
            for a in gl.static_range(BN_GU):
                sg = 2 * a + j
                k = (sg % SPR) * H + cols
                _cp_async(page.slice(a, 1), p_d + (sg // SPR) * I + k,
                          mask=(k < I) & (sg // SPR < BN_D))
        ac.mbarrier_arrive(full.index(slot), increment_count=False)


@gluon.jit
def _mlp_ring_ws_kernel(h_ptr, act_ptr, nw_ptr, wgu_ptr, wd_ptr, cnt_ptr, epoch_ptr, err_ptr,
                        stamp_ptr, n_layers, layer0, G, eps, stall_op, stall_ns, timeout_ns,
                        H: gl.constexpr, I: gl.constexpr, BN_GU: gl.constexpr,
                        BN_D: gl.constexpr, NBUF: gl.constexpr, STALL: gl.constexpr,
                        PW: gl.constexpr, PREGS: gl.constexpr):
    """The ring with the stream and the compute in different warps (gl.warp_specialize): the
    BN_GU compute warps (num_warps) and PW producer warps with PREGS registers a thread. Slot i
    has two barriers: full[i] completes when the producer's copies into it have landed (count
    32 PW, one asynchronous arrive a producer thread), empty[i] when the consumers have read it
    (count 1, after a barrier over the compute warps)."""
    ring = gl.allocate_shared_memory(wgu_ptr.dtype.element_ty, [NBUF, BN_GU, 2, H], _SH)
    full = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(full.index(i), count=32 * PW)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consume, (ring, full, empty, h_ptr, act_ptr, nw_ptr, wgu_ptr, wd_ptr, cnt_ptr,
                    epoch_ptr, err_ptr, stamp_ptr, n_layers, layer0, G, eps, stall_op, stall_ns,
                    timeout_ns, H, I, BN_GU, BN_D, NBUF, STALL, True)),
        (_produce, (ring, full, empty, wgu_ptr, wd_ptr, layer0, n_layers, G, H, I, BN_GU, BN_D,
                    NBUF, PW)),
    ], [PW], [PREGS])




BN_GU = 4           # gate|up row pairs a page, and the compute warps of a program
PREGS = 64          # registers a producer thread (warp_specialize's setmaxnreg)


def constexprs(H, I, nbuf, stall=True, ws=0):
    """The kernel's constexprs for hidden size H, intermediate I, a ring of nbuf pages and ws
    producer warps (0: the single-stream kernel), and its num_warps (the compute warps; a
    warp-specialised program runs ws more)."""
    const = dict(H=H, I=I, BN_GU=BN_GU, BN_D=bn_d(H, I, BN_GU), NBUF=nbuf, STALL=stall)
    if ws:
        const.update(PW=ws, PREGS=PREGS)
    return const, BN_GU


def kernel(ws=0):
    return _mlp_ring_ws_kernel if ws else _mlp_ring_kernel


def _call(grid, h, act, nw, wgu, wd, cnt, epoch, err, stamp, n_layers, layer0, eps, stall_op,
          stall_ns, timeout_ns, nbuf, stall, ws):
    const, num_warps = constexprs(wgu.shape[-1], wd.shape[-1], nbuf, stall, ws)
    return ((h, act, nw, wgu, wd, cnt, epoch, err, stamp, n_layers, layer0, grid, eps, stall_op,
             stall_ns, timeout_ns), dict(const, num_warps=num_warps))


def launch(grid, *args, nbuf, stall=True, ws=0):
    """One chain on `grid` programs (co-resident: one an SM holds one deep ring); args are the
    kernel's runtime arguments from h to timeout_ns, G left out (= grid); ws producer warps."""
    pos, kw = _call(grid, *args, nbuf, stall, ws)
    kernel(ws)[(grid,)](*pos, **kw)


def warmup(grid, *args, nbuf, stall=True, ws=0):
    """The compiled kernel of launch()'s arguments, without launching it."""
    pos, kw = _call(grid, *args, nbuf, stall, ws)
    return kernel(ws).warmup(*pos, grid=(grid,), **kw)


def bn_d(H, I, bn_gu):
    """Down rows a page holds: 2 bn_gu segments of H, ceil(I / H) of them a row."""
    return (2 * bn_gu) // -(-I // H)


def shape_error(H, I, bn_gu):
    """Why this kernel cannot run the shape, or None."""
    if H & (H - 1) or H < 256:
        return f"the hidden size must be a power of two >= 256 (is {H})"
    if bn_gu not in (1, 2, 4, 8, 16) or I % bn_gu:
        return f"bn_gu {bn_gu} (the warps) must be a power of two <= 16 dividing {I}"
    n = bn_d(H, I, bn_gu)
    if n < 1 or H % n:
        return f"a page of 2 x {bn_gu} x {H} must hold whole down rows ({I}) that divide {H}"
    return None
