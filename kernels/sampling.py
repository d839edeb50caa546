"""Everything after the final norm, on the GPU, with no host round-trip.

`lm_head_argmax`: logits = E h (tied embedding [V, D]) in fp32, with a per-row-block argmax
fused in the GEMV epilogue and a one-program reduce to the greedy token. Two forms: a grid of
one program per row block, or (the H200 table's plan) a persistent one of a few programs per SM
that normalise h once and stride over blocks of whole rows, software-pipelined.

`sample_from_logits`: penalties, temperature, top-k, top-p, min-p and a Philox draw, with every
setting read from a small device tensor (`params`) so one captured CUDA graph serves any
settings. Semantics (HF order, with precise tie rules):

  1. l = logits; ids >= valid_vocab are never chosen.
  2. repetition r (HF):  l = l * r if l < 0 else l / r, for ids seen in context + generated.
  3. presence x:         l = l - x, for ids seen in the generated tokens.
  4. greedy (flag set or temperature <= 0): the argmax of l (lowest id on ties). Done.
  5. sort l descending, ties by lower id; p_i = exp((l_i - l_0) / T) (probabilities up to norm).
  6. top-k (k >= 1): keep ranks i with l_i >= l_{k-1} (ties with the k-th are kept, as HF).
  7. top-p: P = p / sum(p over kept); keep rank i iff sum_{j < i, kept} P_j < top_p.
  8. min-p: keep rank i iff p_i >= min_p * p_0 (relative to the most likely token).
  9. rank 0 is always kept; draw from p over the kept ranks (inverse CDF, one uniform).

Candidate cap (documented approximation): steps 5-9 run over the top `top_k_max` ids (rounded
up to a power of two). top_k larger than that is clamped to it; with top_k = 0 (off) and
top_p < 1 or min_p > 0 the nucleus is searched within those ids. The engine passes
sample_candidates(): with top-k set, 2 x top_k candidates (at least 32), so ties with the k-th
reaching past twice k would be cut. Everything else is exact, and
plain temperature sampling (top_k = 0, top_p = 1, min_p = 0) is exact over the whole vocab via
Gumbel-max: argmax_v (l_v / T - log(-log u_v)).

Pipeline (all launches fixed at capture time; a path that the params do not select exits at
once): a prepare kernel over vocab blocks (penalties; per-block sorted top-KC keys or per-block
Gumbel maxima), 0+ merge levels that keep the top KC of groups of candidate runs, and a
one-program final kernel that draws and advances the step counter (and, in the engine's step,
counts the token and advances the position in the same launch). Candidates are
int64 keys (order-preserving float bits << 32 | ~id), so one sort orders by value then lower
id. Every list of candidates is a sequence of sorted runs of KC, odd runs reversed: a merge
program takes the element-wise max of two neighbouring runs (a bitonic sequence holding their
KC best) and sorts it with one bitonic merge, level after level within the program (bitonic
top-k), which costs far fewer exchange rounds than sorting the group.

The random stream: `seed_offset` = int64 device tensor [seed, step]; draw d of a call uses the
Philox counter (step + d) << 32 | lane and the final kernel adds the number of draws to step.
`token_out` may hold n > 1 elements: n independent draws from the same distribution (the tests
use this; the engine draws one).

`counts`: int32 [V] occurrences in the whole history (both penalties use it), or int32 [2, V]
with row 0 = context (prompt) occurrences and row 1 = generated occurrences (repetition sees
both rows, presence only row 1). The drawn token is added to the last row by the launch that
chooses it: `sample_from_logits(..., count=True)` or `lm_head_argmax(..., counts=counts)`.

PyTorch reference: kernels/reference.py, section "sampling": lm_head_argmax_ref, sample_from_logits_ref.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import (FLOAT_DTYPES, cdiv, check_pdl, decode_table, launch_kw, next_pow2, pdl_start,
                      pdl_wait, sm_count)

from . import gemv as _gemv


# layout of the `params` device tensor (float32)
P_TEMPERATURE, P_TOP_K, P_TOP_P, P_MIN_P, P_PRESENCE, P_REPETITION, P_GREEDY = range(7)
NUM_PARAMS = 7
# the "no candidate" key: below every real key, unpacks to (-inf, id -1)
_NEG_INF_ORDERED = -2139095041            # order-preserving int32 of the bits of -inf
KEY_EMPTY = _NEG_INF_ORDERED * (1 << 32)
_KEY_EMPTY = tl.constexpr(KEY_EMPTY)


def params_list(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0, presence_penalty: float = 0.0,
                repetition_penalty: float = 1.0, greedy: bool = False) -> list[float]:
    """The NUM_PARAMS floats of the `params` tensor, in order."""
    vals = [0.0] * NUM_PARAMS
    vals[P_TEMPERATURE] = float(temperature)
    vals[P_TOP_K] = float(max(0, int(top_k)))
    vals[P_TOP_P] = float(top_p)
    vals[P_MIN_P] = float(min_p)
    vals[P_PRESENCE] = float(presence_penalty)
    vals[P_REPETITION] = float(repetition_penalty)
    vals[P_GREEDY] = 1.0 if greedy else 0.0
    return vals


def params_from_sampling(sp) -> list[float]:
    """params_list from an engine.options.SamplingParams."""
    return params_list(sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.presence_penalty,
                       sp.repetition_penalty, sp.is_greedy)


# ------------------------------------------------------------------------------------------
# key packing: (value, id) -> int64 whose signed order is (value, then lower id)
# ------------------------------------------------------------------------------------------

@triton.jit
def _pack(val, idx):
    bits = (val + 0.0).to(tl.int32, bitcast=True)          # + 0.0 folds -0.0 into +0.0
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (4294967295 - idx.to(tl.int64))


@triton.jit
def _unpack_val(key):
    ordered = (key >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _unpack_idx(key):
    return (4294967295 - (key & 4294967295)).to(tl.int32)


# ------------------------------------------------------------------------------------------
# LM head + greedy argmax
# ------------------------------------------------------------------------------------------

@triton.jit
def _lm_head_kernel(h_ptr, nw_ptr, e_ptr, logits_ptr, part_ptr, V, VALID, K, stride_e, eps,
                    PRO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_X: tl.constexpr, ONE_X: tl.constexpr, MASK_N: tl.constexpr,
                    MASK_K: tl.constexpr, PDL: tl.constexpr):
    # PRO = 1: the final zero-centred RMSNorm of h is this GEMV's prologue (rounded to h.dtype)
    pdl_start(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < V
    offs_k = tl.arange(0, BLOCK_K)
    e_rows = e_ptr + rows.to(tl.int64)[:, None] * stride_e
    w0 = _gemv._w_load(e_rows, offs_k, row_mask, offs_k < K, MASK_N, MASK_K)
    nw0 = _gemv._nw_first(nw_ptr, offs_k, offs_k < K, PRO, MASK_K)
    pdl_wait(PDL)
    x0, inv_rms = _gemv._x_first(h_ptr, nw0, offs_k, offs_k < K, K, eps, PRO, MASK_K, BLOCK_X,
                                 ONE_X)
    acc = w0.to(tl.float32) * x0[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = _gemv._x_rms(h_ptr, nw_ptr, ks, k_ok, inv_rms, PRO, MASK_K)
        acc += _gemv._w_tile(e_rows, ks, row_mask, k_ok, MASK_N, MASK_K) * x[None, :]
    logit = tl.sum(acc, axis=1)
    tl.store(logits_ptr + rows, logit, mask=row_mask)
    keys = tl.where(rows < VALID, _pack(logit, rows), _KEY_EMPTY)
    tl.store(part_ptr + pid, tl.max(keys, axis=0))


@triton.jit
def _lm_row_block(logits_ptr, x, rows, V, VALID, w, MASK_N: tl.constexpr):
    """One row block of the persistent LM head: logits of `rows` from its loaded tile `w`
    (stored), and the block's best key."""
    logit = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if MASK_N:
        tl.store(logits_ptr + rows, logit, mask=rows < V)
    else:
        tl.store(logits_ptr + rows, logit)
    keys = tl.where(rows < VALID, _pack(logit, rows), _KEY_EMPTY)
    return tl.max(keys, axis=0)


@triton.jit
def _lm_e_load(e_ptr, rows, offs_k, V, K, stride_e, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
               EVICT: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of whole rows of E (masked only where the shape is ragged)."""
    return _gemv._w_load(e_ptr + rows.to(tl.int64)[:, None] * stride_e, offs_k, rows < V,
                         offs_k < K, MASK_N, MASK_K, EVICT)


@triton.jit
def _lm_head_persistent_kernel(h_ptr, nw_ptr, e_ptr, logits_ptr, part_ptr, V, VALID, K,
                               stride_e, eps, NB, PRO: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, MASK_N: tl.constexpr,
                               MASK_K: tl.constexpr, STAGES: tl.constexpr,
                               EVICT: tl.constexpr, PDL: tl.constexpr):
    # Persistent form: a few programs per SM, each normalising h once and then striding over
    # row blocks of whole rows (BLOCK_K >= K), software-pipelined STAGES deep, so the whole
    # launch streams E with several tiles in flight per SM; one key per program.
    pdl_start(PDL)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w0 = _lm_e_load(e_ptr, rows, offs_k, V, K, stride_e, MASK_N, MASK_K, EVICT)
    nw0 = _gemv._nw_first(nw_ptr, offs_k, k_ok, PRO, MASK_K)
    pdl_wait(PDL)
    x, _inv = _gemv._x_first(h_ptr, nw0, offs_k, k_ok, K, eps, PRO, MASK_K, BLOCK_K, True)
    best = _lm_row_block(logits_ptr, x, rows, V, VALID, w0, MASK_N)
    for b in tl.range(pid + nprog, NB, nprog, num_stages=STAGES):
        rows = b * BLOCK_N + tl.arange(0, BLOCK_N)
        w = _lm_e_load(e_ptr, rows, offs_k, V, K, stride_e, MASK_N, MASK_K, EVICT)
        best = tl.maximum(best, _lm_row_block(logits_ptr, x, rows, V, VALID, w, MASK_N))
    tl.store(part_ptr + pid, best)


@triton.jit
def _argmax_keys_kernel(part_ptr, n, token_ptr, counts_ptr, row_offset, pos_ptr, ring_ptr,
                        BLOCK: tl.constexpr, COUNT: tl.constexpr, ADVANCE: tl.constexpr,
                        RING: tl.constexpr, PDL: tl.constexpr):
    # the per-block keys -> token; COUNT: counts[row_offset + token] += 1 (the generated-token
    # row the penalties read); ADVANCE: pos += 1 (the step's last write), and with RING > 0
    # the token also goes to ring[pos % RING] (the host reads it there while later steps run)
    pdl_start(PDL)
    pdl_wait(PDL)
    best = tl.full((BLOCK,), _KEY_EMPTY, dtype=tl.int64)
    for i0 in range(0, n, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        best = tl.maximum(best, tl.load(part_ptr + offs, mask=offs < n,
                                        other=_KEY_EMPTY))
    tok = _unpack_idx(tl.max(best, axis=0))
    tl.store(token_ptr, tok.to(token_ptr.dtype.element_ty))
    _count_and_advance(tok, counts_ptr, row_offset, pos_ptr, ring_ptr, COUNT, ADVANCE, RING)


@triton.jit
def _count_and_advance(tok, counts_ptr, row_offset, pos_ptr, ring_ptr, COUNT: tl.constexpr,
                       ADVANCE: tl.constexpr, RING: tl.constexpr):
    """counts[row_offset + tok] += 1 (COUNT); then pos += 1, with the ring write (ADVANCE)."""
    if COUNT:
        c = tl.load(counts_ptr + row_offset + tok.to(tl.int64))
        tl.store(counts_ptr + row_offset + tok.to(tl.int64), c + 1)
    if ADVANCE:
        _advance(pos_ptr, ring_ptr, tok, RING)


@triton.jit
def _advance(pos_ptr, ring_ptr, tok, RING: tl.constexpr):
    """pos += 1; with RING > 0 first ring[pos % RING] = tok (the step's token by position)."""
    p = tl.load(pos_ptr)
    if RING > 0:
        tl.store(ring_ptr + p % RING, tok.to(ring_ptr.dtype.element_ty))
    tl.store(pos_ptr, p + 1)


def lm_head_plan(vocab: int, dim: int, fused_norm: bool = False) -> dict:
    """dict(block_n, block_k, num_warps, persistent, num_stages, evict) of lm_head_argmax:
    decode_tuning.json's entry 'lm_head:{V}x{D}:{rms|none}', else ~4K-element tiles of the
    grid form. Size the partials with lm_head_partials_numel(V, block_n) (enough for
    either form)."""
    e = decode_table().get(f"lm_head:{vocab}x{dim}:{'rms' if fused_norm else 'none'}")
    if e is not None:
        try:
            return dict(block_n=int(e["block_n"]), block_k=int(e["block_k"]),
                        num_warps=int(e["num_warps"]), persistent=int(e.get("persistent", 0)),
                        num_stages=int(e.get("num_stages", 1)), evict=bool(e.get("evict", True)))
        except (KeyError, TypeError, ValueError):
            pass
    # the grid form with ~4K-element tiles
    block_k = min(512, next_pow2(max(dim, 16)))
    block_n = max(1, min(64, 4096 // block_k, next_pow2(vocab)))
    return dict(block_n=block_n, block_k=block_k, num_warps=4, persistent=0, num_stages=1,
                evict=True)


def lm_head_partials_numel(vocab: int, block_n: int) -> int:
    """int64 elements of the per-block argmax scratch of lm_head_argmax."""
    return cdiv(vocab, block_n)


def lm_head_argmax(h: torch.Tensor, E: torch.Tensor, valid_vocab: int,
                   logits_out: torch.Tensor, token_out: torch.Tensor, partials: torch.Tensor,
                   *, norm_w: Optional[torch.Tensor] = None, eps: float = 1e-6,
                   block_n: Optional[int] = None, block_k: Optional[int] = None,
                   num_warps: Optional[int] = None, counts: Optional[torch.Tensor] = None,
                   pos: Optional[torch.Tensor] = None,
                   ring: Optional[torch.Tensor] = None, persistent: Optional[int] = None,
                   num_stages: Optional[int] = None, evict: Optional[bool] = None,
                   pdl: int = 0) -> torch.Tensor:
    """logits_out = E @ h (float32 [V], padded rows included); token_out[0] = argmax over
    ids < valid_vocab (lowest id on ties). h [D] or [1, D]; E [V, D] contiguous; partials
    int64 with >= lm_head_partials_numel(V, block_n) elements. With norm_w [D] the final
    zero-centred RMSNorm is fused: logits = E @ round(rms_norm(h, norm_w, eps)), h being the
    raw residual stream. `counts` (int32 [V] or [2, V]): the token is counted in its last row
    (the generated row of [2, V]); `pos` (one int on the device): pos += 1 after the token is
    chosen; `ring` (int64 [R], with pos): ring[pos % R] = token before the advance.
    `persistent` (programs per SM, 0 = the grid form of one program per row block),
    `num_stages` and `evict` (E's loads marked evict-first) complete the plan; unset, they and
    the tile sizes come from lm_head_plan. `pdl`: see _common.pdl_mode.
    Returns token_out."""
    pdl = check_pdl(pdl, "lm_head_argmax")
    if E.dim() != 2 or not E.is_contiguous() or E.dtype not in FLOAT_DTYPES:
        raise ValueError("lm_head_argmax: E must be a contiguous [V, D] float matrix")
    V, D = E.shape
    if h.numel() != D or not h.is_contiguous() or h.dtype not in FLOAT_DTYPES:
        raise ValueError(f"lm_head_argmax: h must be a contiguous [{D}] float vector")
    if not 1 <= int(valid_vocab) <= V:
        raise ValueError(f"lm_head_argmax: valid_vocab must be in 1..{V}")
    if (logits_out.numel() != V or logits_out.dtype != torch.float32
            or not logits_out.is_contiguous()):
        raise ValueError(f"lm_head_argmax: logits_out must be a contiguous float32 [{V}]")
    if token_out.numel() < 1 or token_out.dtype not in (torch.int32, torch.int64):
        raise ValueError("lm_head_argmax: token_out must be an int32/int64 tensor")
    if norm_w is not None and (norm_w.numel() != D or not norm_w.is_contiguous()
                               or norm_w.device != h.device):
        raise ValueError(f"lm_head_argmax: norm_w must be a contiguous [{D}] vector")
    if block_n is None or block_k is None or num_warps is None:
        p = lm_head_plan(V, D, norm_w is not None)
        block_n, block_k, num_warps = (block_n or p["block_n"], block_k or p["block_k"],
                                       num_warps or p["num_warps"])
        persistent = p["persistent"] if persistent is None else persistent
        num_stages = p["num_stages"] if num_stages is None else num_stages
        evict = p["evict"] if evict is None else evict
    persistent = int(persistent or 0)
    if persistent < 0:
        raise ValueError("lm_head_argmax: persistent must be >= 0 programs per SM")
    if persistent and next_pow2(D) > LM_PERSISTENT_MAX_K:
        raise ValueError(f"lm_head_argmax: the persistent form holds whole rows of at most "
                         f"{LM_PERSISTENT_MAX_K} (D = {D})")
    nb = cdiv(V, block_n)
    if partials.dtype != torch.int64 or partials.numel() < nb or not partials.is_contiguous():
        raise ValueError(f"lm_head_argmax: partials must be contiguous int64 with >= {nb} "
                         "elements")
    for t in (E, logits_out, token_out, partials):
        if t.device != h.device:
            raise ValueError("lm_head_argmax: all tensors must be on one device")
    if persistent:
        # one key per program; the grid never exceeds the row blocks (sm_count is cached)
        nkeys = min(nb, persistent * sm_count(h.device))
        bk = next_pow2(D)
        _lm_head_persistent_kernel[(nkeys,)](
            h, norm_w if norm_w is not None else h, E, logits_out, partials, V, int(valid_vocab),
            D, E.stride(0), float(eps), nb, PRO=1 if norm_w is not None else 0, BLOCK_N=block_n,
            BLOCK_K=bk, MASK_N=V % block_n != 0, MASK_K=D != bk, STAGES=int(num_stages or 1),
            EVICT=bool(evict), PDL=pdl, num_warps=num_warps,
            **launch_kw(pdl))
    else:
        nkeys = nb
        block_x = min(1024, next_pow2(D))
        _lm_head_kernel[(nb,)](h, norm_w if norm_w is not None else h, E, logits_out, partials, V,
                               int(valid_vocab), D, E.stride(0), float(eps),
                               PRO=1 if norm_w is not None else 0, BLOCK_N=block_n,
                               BLOCK_K=block_k, BLOCK_X=block_x, ONE_X=block_x >= D,
                               MASK_N=V % block_n != 0, MASK_K=D % block_k != 0,
                               PDL=pdl, num_warps=num_warps,
                               **launch_kw(pdl))
    # one program, one pass over the keys when they fit (16 warps hold 16K keys)
    block = min(ARGMAX_BLOCK_MAX, next_pow2(nkeys))
    _argmax_keys_kernel[(1,)](partials, nkeys, token_out, *_count_args(counts, token_out, pos, ring),
                              BLOCK=block, COUNT=counts is not None, ADVANCE=pos is not None,
                              RING=ring.numel() if ring is not None else 0,
                              PDL=pdl, num_warps=16 if block >= 8192 else 4,
                              **launch_kw(pdl))
    return token_out


ARGMAX_BLOCK_MAX = 16384      # keys the final argmax reduces per pass (loops past it)
LM_PERSISTENT_MAX_K = 4096    # widest row the persistent LM head holds in one tile


def _count_args(counts: Optional[torch.Tensor], token: torch.Tensor,
                pos: Optional[torch.Tensor], ring: Optional[torch.Tensor] = None) -> tuple:
    """(counts, row_offset, pos, ring) kernel arguments of the fused count / position update,
    with the token buffer as a never-touched dummy for what is absent."""
    if counts is not None:
        if counts.dtype != torch.int32 or not counts.is_contiguous() or counts.dim() not in (1, 2):
            raise ValueError("counts must be contiguous int32 [V] or [2, V]")
        if counts.device != token.device:
            raise ValueError("counts and token must be on one device")
    if pos is not None:
        if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != token.device:
            raise ValueError("pos must be a one-element int32/int64 tensor on the token's device")
    if ring is not None:
        if pos is None:
            raise ValueError("the token ring is written with the position advance: pass pos")
        if ring.dtype != torch.int64 or not ring.is_contiguous() or ring.numel() < 1 \
                or ring.device != token.device:
            raise ValueError("ring must be a contiguous int64 tensor on the token's device")
    row_offset = counts.shape[-1] if counts is not None and counts.dim() == 2 else 0
    return (counts if counts is not None else token, row_offset,
            pos if pos is not None else token, ring if ring is not None else token)


# ------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------

@triton.jit
def _modes(params_ptr):
    """(is_greedy, use_gumbel) from the params tensor."""
    temperature = tl.load(params_ptr + 0)
    top_k = tl.load(params_ptr + 1)
    top_p = tl.load(params_ptr + 2)
    min_p = tl.load(params_ptr + 3)
    greedy = (tl.load(params_ptr + 6) != 0.0) | (temperature <= 0.0)
    gumbel = (~greedy) & (top_k < 1.0) & (top_p >= 1.0) & (min_p <= 0.0)
    return greedy, gumbel


@triton.jit
def _sample_prepare_kernel(logits_ptr, counts_ptr, params_ptr, seed_ptr, cand_ptr, gum_ptr,
                           V, VALID, N_DRAWS, NB,
                           TWO_ROWS: tl.constexpr, KC: tl.constexpr, BLOCK_V: tl.constexpr,
                           DRAW_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < VALID
    l = tl.load(logits_ptr + offs, mask=valid, other=float("-inf"))
    if TWO_ROWS:
        c_gen = tl.load(counts_ptr + V + offs, mask=valid, other=0)
        seen = (tl.load(counts_ptr + offs, mask=valid, other=0) + c_gen) > 0
        generated = c_gen > 0
    else:
        seen = tl.load(counts_ptr + offs, mask=valid, other=0) > 0
        generated = seen
    rep = tl.load(params_ptr + 5)
    l = tl.where(seen, tl.where(l < 0.0, l * rep, l / rep), l)
    l = tl.where(generated, l - tl.load(params_ptr + 4), l)
    l = tl.where(valid, l, float("-inf"))

    greedy, gumbel = _modes(params_ptr)
    if gumbel:
        # exact temperature sampling: per block and draw, argmax of l/T + Gumbel noise
        seed = tl.load(seed_ptr)
        step = tl.load(seed_ptr + 1)
        draws = pid_d * DRAW_BLOCK + tl.arange(0, DRAW_BLOCK)
        ctr = ((step + draws.to(tl.int64)) << 32)[:, None] | offs.to(tl.int64)[None, :]
        u = tl.rand(seed, ctr)
        z = l[None, :] / tl.load(params_ptr + 0) - tl.log(-tl.log(u))
        keys = tl.where(valid[None, :], _pack(z, offs[None, :]), _KEY_EMPTY)
        tl.store(gum_ptr + draws.to(tl.int64) * NB + pid, tl.max(keys, axis=1),
                 mask=draws < N_DRAWS)
    else:
        if pid_d == 0:
            # this block's KC best (value, lower id) keys, best first
            keys = tl.sort(_pack(l, offs), descending=True)
            r = tl.arange(0, BLOCK_V)
            _store_run(cand_ptr, pid, keys, r, KC)


@triton.jit
def _store_run(out_ptr, run, keys, r, KC: tl.constexpr):
    """Store the first KC of `keys` (best first; r = arange over keys) as run `run` of the
    candidate list; odd runs are stored reversed (ascending), so that two neighbouring runs
    read together form a bitonic sequence for _merge_runs."""
    pos = tl.where(run % 2 == 1, KC - 1 - r, r)
    tl.store(out_ptr + run * KC + pos, keys, mask=r < KC)


@triton.jit
def _merge_runs(keys, CHUNK: tl.constexpr, KC: tl.constexpr):
    """The KC best of CHUNK keys that hold CHUNK / KC (2 to 64) runs of KC, even runs descending
    and odd runs ascending: per pair of runs the element-wise max is a bitonic sequence holding
    the pair's KC best (bitonic top-k), which one bitonic merge (log2 KC exchange rounds) sorts;
    the odd ones of those reversed, pairs again, until one run is left. Returns [KC], best
    first."""
    ROWS: tl.constexpr = CHUNK // KC // 2
    tl.static_assert(ROWS >= 1 and ROWS <= 32)
    c = tl.max(tl.reshape(keys, (ROWS, 2, KC)), axis=1)
    for lv in tl.static_range(5):                 # rows of runs left: ROWS >> lv
        if (ROWS >> lv) >= 2:
            c = tl.bitonic_merge(c, descending=True)
            c = tl.where((tl.arange(0, ROWS >> lv) % 2 == 1)[:, None], tl.flip(c, 1), c)
            c = tl.max(tl.reshape(c, ((ROWS >> lv) // 2, 2, KC)), axis=1)
    return tl.reshape(tl.bitonic_merge(c, descending=True), (KC,))


@triton.jit
def _topk_merge_kernel(in_ptr, n_in, out_ptr, params_ptr,
                       KC: tl.constexpr, CHUNK: tl.constexpr):
    # one group of CHUNK / KC runs of candidate keys -> its KC best, stored as run `pid` of
    # the next level (runs past the last are all empty keys: constant, so in either order)
    greedy, gumbel = _modes(params_ptr)
    if not gumbel:
        pid = tl.program_id(0)
        offs = pid * CHUNK + tl.arange(0, CHUNK)
        keys = tl.load(in_ptr + offs, mask=offs < n_in, other=_KEY_EMPTY)
        _store_run(out_ptr, pid, _merge_runs(keys, CHUNK, KC), tl.arange(0, KC), KC)


@triton.jit
def _sample_final_kernel(cand_ptr, n_cand, gum_ptr, NB, params_ptr, seed_ptr, token_ptr,
                         N_DRAWS, counts_ptr, row_offset, pos_ptr, ring_ptr,
                         KC: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK_NB: tl.constexpr, DRAW_BLOCK: tl.constexpr,
                         COUNT: tl.constexpr, ADVANCE: tl.constexpr, RING: tl.constexpr):
    # COUNT / ADVANCE / RING: the first draw counted, the position advanced, in this launch
    greedy, gumbel = _modes(params_ptr)
    seed = tl.load(seed_ptr)
    step = tl.load(seed_ptr + 1)
    out_ty = token_ptr.dtype.element_ty
    tok0 = tl.program_id(0) * 0                         # the first draw's token
    if gumbel:
        nb = tl.arange(0, BLOCK_NB)
        for d0 in range(0, N_DRAWS, DRAW_BLOCK):
            draws = d0 + tl.arange(0, DRAW_BLOCK)
            dm = draws < N_DRAWS
            keys = tl.load(gum_ptr + draws.to(tl.int64)[:, None] * NB + nb[None, :],
                           mask=dm[:, None] & (nb < NB)[None, :], other=_KEY_EMPTY)
            tok = _unpack_idx(tl.max(keys, axis=1))
            tl.store(token_ptr + draws, tok.to(out_ty), mask=dm)
            tok0 = tl.where(d0 == 0, tl.sum(tl.where(draws == 0, tok, 0), axis=0), tok0)
    else:
        # the candidate runs (see _store_run) -> the KC best, best first
        if CHUNK > KC:
            lane = tl.arange(0, CHUNK)
            keys = _merge_runs(tl.load(cand_ptr + lane, mask=lane < n_cand, other=_KEY_EMPTY),
                               CHUNK, KC)
        else:
            keys = tl.load(cand_ptr + tl.arange(0, KC))     # one run, stored best first
        rank = tl.arange(0, KC)
        vals = _unpack_val(keys)
        ids = _unpack_idx(keys)
        v_top = tl.max(vals, axis=0)
        temperature = tl.load(params_ptr + 0)
        top_k = tl.load(params_ptr + 1).to(tl.int32)
        top_p = tl.load(params_ptr + 2)
        min_p = tl.load(params_ptr + 3)
        k_eff = tl.where(top_k >= 1, tl.minimum(top_k, KC), KC)
        v_kth = tl.sum(tl.where(rank == k_eff - 1, vals, 0.0), axis=0)
        keep = vals >= v_kth                                             # top-k, ties kept
        t_safe = tl.where(greedy, 1.0, temperature)                      # T <= 0: unused
        pw = tl.where(keep, tl.exp((vals - v_top) / t_safe), 0.0)        # p_i / p_0
        prob = pw / tl.sum(pw, axis=0)
        before = tl.cumsum(prob, axis=0) - prob                          # mass ranked above
        keep = keep & ((before < top_p) | (rank == 0))                   # top-p
        keep = keep & ((pw >= min_p) | (rank == 0))                      # min-p
        # greedy: rank 0 only
        w = tl.where(greedy, tl.where(rank == 0, 1.0, 0.0), tl.where(keep, pw, 0.0))
        n_pos = tl.sum((w > 0.0).to(tl.int32), axis=0)                  # kept set = prefix
        cum = tl.cumsum(w, axis=0)
        total = tl.sum(w, axis=0)
        for d0 in range(0, N_DRAWS, DRAW_BLOCK):
            draws = d0 + tl.arange(0, DRAW_BLOCK)
            u = tl.rand(seed, (step + draws.to(tl.int64)) << 32)
            r = u * total
            chosen = tl.sum(((cum[None, :] <= r[:, None]) & (rank < n_pos)[None, :]).to(tl.int32),
                            axis=1)
            chosen = tl.minimum(chosen, n_pos - 1)
            tok = tl.sum(tl.where(rank[None, :] == chosen[:, None], ids[None, :], 0), axis=1)
            tl.store(token_ptr + draws, tok.to(out_ty), mask=draws < N_DRAWS)
            tok0 = tl.where(d0 == 0, tl.sum(tl.where(draws == 0, tok, 0), axis=0), tok0)
    tl.store(seed_ptr + 1, step + N_DRAWS)
    _count_and_advance(tok0, counts_ptr, row_offset, pos_ptr, ring_ptr, COUNT, ADVANCE, RING)


SAMPLE_BLOCK = 256           # smallest vocab block of the sampler (2 x candidates at least)
SAMPLE_MERGE_RUNS = 16       # runs of candidates a merge program takes (see _merge_runs) ...
SAMPLE_MERGE_MAX = 2048      # ... up to this many keys (both measured in the step on the H200)


def sample_candidates(top_k: int, top_p: float, min_p: float, cap: int) -> int:
    """The candidate count (a power of two, at most `cap`) the sampler needs for these
    settings: twice top_k when it is set (ties with the k-th are kept, as HF does; past twice
    top_k they would be cut), the whole cap when only top-p / min-p choose the nucleus, and the
    smallest (32) for plain temperature, which draws exactly over the whole vocab without
    candidates."""
    cap = next_pow2(max(1, int(cap)))
    if int(top_k) >= 1:
        return min(cap, max(32, next_pow2(2 * int(top_k))))
    if top_p < 1.0 or min_p > 0.0:
        return cap
    return min(cap, 32)


def sample_plan(vocab: int, top_k_max: int, n_draws: int = 1, *,
                block_v: Optional[int] = None, merge_chunk: Optional[int] = None) -> dict:
    """Launch geometry of sample_from_logits (fixed per vocab/top_k_max/n_draws) and the
    int64 scratch it needs: dict(kc, block_v, nb, chunk, levels=[(n_in, programs, in_off,
    out_off)], final_off, n_final, gum_off, draw_block, scratch_numel)."""
    kc = next_pow2(max(1, int(top_k_max)))
    # small vocab blocks: every block's sort is short (a 4,096-key sort costs ~60 us on the
    # H200, a 512-key one a few). A merge program takes up to 16 sorted runs (2,048 keys) and
    # merges them instead of sorting them, so the levels are few: at the true vocab 2 for 64
    # candidates (top-k 20) and for 256 (top-p alone), the final kernel merging the last runs,
    # where full sorts of 256 / 512 keys needed 4 and 8 levels and a sort in the final kernel.
    # In the sampled step on the H200 (ms at 640, top-k 20 / top-p 0.9): 0.6210 / 0.6209 with
    # the full sorts, 0.6165 / 0.6128 merging (greedy: 0.6047). (Those top-p times match top-p
    # with top-k 20 still set; top-p alone, 256 candidates, measured 0.627 ms.)
    if block_v is None:
        block_v = max(2 * kc, min(SAMPLE_BLOCK, next_pow2(vocab)))
    if merge_chunk is None:
        merge_chunk = max(2 * kc, min(SAMPLE_MERGE_RUNS * kc, SAMPLE_MERGE_MAX))
    if block_v < kc or block_v & (block_v - 1):
        raise ValueError("sample_plan: block_v must be a power of two >= top_k_max")
    if merge_chunk < 2 * kc or merge_chunk & (merge_chunk - 1) or merge_chunk > 64 * kc:
        raise ValueError("sample_plan: merge_chunk must be a power of two from 2 to 64 times "
                         "top_k_max")
    nb = cdiv(vocab, block_v)
    draw_block = min(next_pow2(n_draws), max(1, 4096 // block_v))
    gum_off, off = 0, n_draws * nb
    n, in_off = nb * kc, off
    off += n
    levels = []
    while n > merge_chunk:
        programs = cdiv(n, merge_chunk)
        levels.append((n, programs, in_off, off))
        in_off, n = off, programs * kc
        off += n
    return dict(kc=kc, block_v=block_v, nb=nb, chunk=merge_chunk, levels=levels,
                final_off=in_off, n_final=n, gum_off=gum_off, draw_block=draw_block,
                scratch_numel=off)


def sample_scratch_numel(vocab: int, top_k_max: int, n_draws: int = 1, **kw) -> int:
    """int64 elements of scratch sample_from_logits needs (allocate once, at load time); enough
    for every smaller candidate count too (sample_candidates may choose one)."""
    kc = next_pow2(max(1, int(top_k_max)))
    sizes = []
    while True:
        sizes.append(sample_plan(vocab, kc, n_draws, **kw)["scratch_numel"])
        if kc <= 1:
            break
        kc //= 2
    return max(sizes)


def sample_from_logits(logits: torch.Tensor, params: torch.Tensor, counts: torch.Tensor,
                       seed_offset: torch.Tensor, token_out: torch.Tensor,
                       scratch: torch.Tensor, *, valid_vocab: int, top_k_max: int,
                       block_v: Optional[int] = None,
                       merge_chunk: Optional[int] = None, count: bool = False,
                       pos: Optional[torch.Tensor] = None,
                       ring: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Draw token_out.numel() tokens from the processed logits (see the module docstring).

    logits float32 [V]; params float32 [NUM_PARAMS] (params_list); counts int32 [V] or [2, V];
    seed_offset int64 [2] = (seed, step), step advanced in place; token_out int32/int64 [n];
    scratch int64 with >= sample_scratch_numel(V, top_k_max, n) elements. `count`: the first
    token is counted in the last row of `counts`; `pos` (one int on the device): pos += 1 after
    the draw; `ring` (int64 [R], with pos): ring[pos % R] = the first token before the advance.
    Returns token_out."""
    if logits.dim() != 1 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError("sample_from_logits: logits must be a contiguous float32 [V] vector")
    V = logits.numel()
    if not 1 <= int(valid_vocab) <= V:
        raise ValueError(f"sample_from_logits: valid_vocab must be in 1..{V}")
    if params.dtype != torch.float32 or params.numel() < NUM_PARAMS or not params.is_contiguous():
        raise ValueError(f"sample_from_logits: params must be float32 with {NUM_PARAMS} values")
    two_rows = counts.dim() == 2
    if (counts.dtype != torch.int32 or not counts.is_contiguous()
            or tuple(counts.shape) not in ((V,), (2, V))):
        raise ValueError(f"sample_from_logits: counts must be contiguous int32 [{V}] or [2, {V}]")
    if seed_offset.dtype != torch.int64 or seed_offset.numel() != 2:
        raise ValueError("sample_from_logits: seed_offset must be int64 [2] = (seed, step)")
    if token_out.dtype not in (torch.int32, torch.int64) or token_out.numel() < 1:
        raise ValueError("sample_from_logits: token_out must be an int32/int64 tensor")
    n_draws = token_out.numel()
    p = sample_plan(V, top_k_max, n_draws, block_v=block_v, merge_chunk=merge_chunk)
    if (scratch.dtype != torch.int64 or not scratch.is_contiguous()
            or scratch.numel() < p["scratch_numel"]):
        raise ValueError(f"sample_from_logits: scratch must be contiguous int64 with >= "
                         f"{p['scratch_numel']} elements")
    for t in (params, counts, seed_offset, token_out, scratch):
        if t.device != logits.device:
            raise ValueError("sample_from_logits: all tensors must be on one device")

    kc, block_v, nb, chunk = p["kc"], p["block_v"], p["nb"], p["chunk"]
    gum = scratch[p["gum_off"]:]
    first = p["levels"][0][2] if p["levels"] else p["final_off"]
    _sample_prepare_kernel[(nb, cdiv(n_draws, p["draw_block"]))](
        logits, counts, params, seed_offset, scratch[first:], gum, V, int(valid_vocab),
        n_draws, nb, TWO_ROWS=two_rows, KC=kc, BLOCK_V=block_v, DRAW_BLOCK=p["draw_block"],
        num_warps=8 if block_v >= 2048 else 4)
    for n_in, programs, in_off, out_off in p["levels"]:
        _topk_merge_kernel[(programs,)](scratch[in_off:], n_in, scratch[out_off:], params,
                                        KC=kc, CHUNK=chunk, num_warps=8)
    chunk_f = max(kc, next_pow2(p["n_final"]))
    block_nb = next_pow2(nb)
    # draws per iteration of the final loop: keep its [DRAW_BLOCK, KC] (or, Gumbel-max,
    # [DRAW_BLOCK, BLOCK_NB]) tile around 8K values
    draw_block = min(next_pow2(n_draws), max(1, 8192 // max(kc, block_nb)))
    _sample_final_kernel[(1,)](
        scratch[p["final_off"]:], p["n_final"], gum, nb, params, seed_offset, token_out,
        n_draws, *_count_args(counts if count else None, token_out, pos, ring), KC=kc,
        CHUNK=chunk_f, BLOCK_NB=block_nb, DRAW_BLOCK=draw_block, COUNT=bool(count),
        ADVANCE=pos is not None, RING=ring.numel() if ring is not None else 0, num_warps=8)
    return token_out
