"""kernels/sampling.py against reference.lm_head_argmax_ref / sample_from_logits_ref: the LM
head + argmax (the final norm fused), and the on-device sampler: greedy exactness, the
distribution of many draws (chi-square with fixed seeds), the seed/step stream, counts."""
import math

import pytest
import torch

from tests.kernels.util import DTYPES, EPS, Q08, tol, vec
from tritonchat.engine.options import SamplingParams
from tritonchat.kernels.reference import (lm_head_argmax_ref, penalized_logits_ref,
                                          sample_from_logits_ref)
from tritonchat.kernels.sampling import (lm_head_argmax, lm_head_partials_numel,
                                         params_from_sampling, params_list, sample_from_logits,
                                         sample_plan, sample_scratch_numel)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V, VALID = 50, 45          # ids 45..49 play the padded embedding rows


def build_counts(context_ids, generated_ids, vocab: int, device=None) -> torch.Tensor:
    """A fresh int32 [2, vocab] counts tensor from host id lists (allocates: call it when
    sampling starts, outside any captured graph)."""
    counts = torch.zeros(2, vocab, dtype=torch.int32)
    for row, ids in enumerate((context_ids, generated_ids)):
        if len(ids):
            t = torch.as_tensor(list(ids), dtype=torch.int64)
            counts[row] += torch.bincount(t, minlength=vocab)[:vocab].to(torch.int32)
    return counts.to(device) if device is not None else counts



# ------------------------------------------------------------------------------------------
# LM head
# ------------------------------------------------------------------------------------------

def _lm_head(h, E, valid, block_n, block_k):
    logits = torch.full((E.shape[0],), float("nan"), device=DEVICE)
    tok = torch.full((1,), -1, device=DEVICE, dtype=torch.int32)
    part = torch.empty(lm_head_partials_numel(E.shape[0], block_n), device=DEVICE,
                       dtype=torch.int64)
    lm_head_argmax(h, E, valid, logits, tok, part, block_n=block_n, block_k=block_k,
                   num_warps=4)
    return logits, int(tok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lm_head_argmax(dtype):
    g = torch.Generator().manual_seed(0)
    D = 40                                   # not a multiple of block_k = 16
    h = torch.randn(D, generator=g).to(DEVICE, dtype)
    E = torch.randn(V, D, generator=g).to(DEVICE, dtype)
    logits, tok = _lm_head(h, E, VALID, block_n=8, block_k=16)
    want_logits, want_tok = lm_head_argmax_ref(h, E, VALID)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-4)
    assert tok == want_tok == int(torch.argmax(logits[:VALID]))


def test_lm_head_argmax_padding_and_ties():
    g = torch.Generator().manual_seed(1)
    D = 32
    h = torch.randn(D, generator=g).to(DEVICE)
    E = torch.randn(V, D, generator=g).to(DEVICE) * 0.1
    E[VALID:] = h * 10                       # padded rows would win if they were eligible
    E[30] = h                                # the best real row...
    E[12] = h                                # ...tied with a lower id, in another block
    logits, tok = _lm_head(h, E, VALID, block_n=8, block_k=16)
    assert tok == 12
    assert float(logits[VALID:].min()) > float(logits[:VALID].max())   # padded logits kept


@pytest.mark.parametrize("reduce_block", [pytest.param(None, marks=pytest.mark.slow), 256])
def test_lm_head_argmax_many_blocks(reduce_block, monkeypatch):
    # 1050 row blocks: the final reduce reads them in one 2048-wide pass, or, capped at 256
    # keys per pass, loops 5 times; the winner sits in the last pass
    import tritonchat.kernels.sampling as S
    if reduce_block is not None:
        monkeypatch.setattr(S, "ARGMAX_BLOCK_MAX", reduce_block)
    g = torch.Generator().manual_seed(2)
    n, D = 2100, 16
    h = torch.randn(D, generator=g).to(DEVICE)
    E = torch.randn(n, D, generator=g).to(DEVICE)
    E[2061] = h * 3
    logits, tok = _lm_head(h, E, 2080, block_n=2, block_k=16)
    assert tok == 2061 == lm_head_argmax_ref(h, E, 2080)[1]


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_lm_head_argmax_counts_token_and_advances_position(pos_dtype):
    # the step's last kernel also counts the token (generated row) and moves pos by one
    g = torch.Generator().manual_seed(6)
    D = 32
    h = torch.randn(D, generator=g).to(DEVICE)
    E = torch.randn(V, D, generator=g).to(DEVICE)
    want = lm_head_argmax_ref(h, E, VALID)[1]
    counts = build_counts([want, 3], [want], V, device=DEVICE)
    pos = torch.tensor([41], device=DEVICE, dtype=pos_dtype)
    logits = torch.empty(V, device=DEVICE)
    tok = torch.empty(1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(V, 4), device=DEVICE, dtype=torch.int64)
    ring = torch.full((4,), -1, device=DEVICE, dtype=torch.int64)
    for step in range(2):
        lm_head_argmax(h, E, VALID, logits, tok, part, block_n=4, block_k=16, counts=counts,
                       pos=pos, ring=ring)
        assert int(tok[0]) == want
        assert int(counts[1, want]) == 2 + step and int(counts[0, want]) == 1
        assert int(pos[0]) == 42 + step
    assert int(counts.sum()) == 5
    # the token of the step at position p sits in ring[p % 4]: positions 41 and 42
    assert ring.tolist() == [-1, want, want, -1]
    with pytest.raises(ValueError, match="pos"):          # the ring goes with the advance
        lm_head_argmax(h, E, VALID, logits, tok, part, block_n=4, block_k=16, ring=ring)
    # without pos the position is left alone; without counts nothing is counted
    lm_head_argmax(h, E, VALID, logits, tok, part, block_n=4, block_k=16)
    assert int(pos[0]) == 43 and int(counts.sum()) == 5


# the persistent form: a few programs per SM (4 "SMs" under the interpreter), each striding
# over whole-row blocks; (rows, D, valid, block_n, programs per SM, stages, evict, norm)
PERSISTENT_CASES = [
    (50, 40, 45, 8, 1, 1, True, False),       # 7 blocks over 4 programs, ragged D and V
    (50, 40, 45, 4, 2, 2, False, True),       # 13 blocks over 8 programs, fused norm
    (203, 24, 200, 8, 1, 3, True, True),      # 26 blocks, 6-7 per program, 3 stages
    (64, 64, 64, 16, 2, 2, True, True),       # 4 blocks < 8 programs: the grid is cut to 4
    (1, 16, 1, 4, 1, 1, True, False),         # one row
]


@pytest.mark.parametrize("case", PERSISTENT_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_argmax_persistent(case, dtype):
    n, D, valid, bn, per_sm, stages, evict, norm = case
    g = torch.Generator().manual_seed(n + D)
    h = torch.randn(D, generator=g).to(DEVICE, dtype)
    E = (torch.randn(n, D, generator=g) * 0.3).to(DEVICE, dtype)
    nw = (torch.randn(D, generator=g) * 0.2).to(DEVICE, dtype) if norm else None
    if n > 1:
        E[n - 1] = E[0] = E[valid // 2].clone()            # a tie across programs...
        E[valid // 2] = E[valid // 2] * 2 + 0.5            # ...below the best row
    logits = torch.full((n,), float("nan"), device=DEVICE)
    tok = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    part = torch.full((lm_head_partials_numel(n, bn),), 5, device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, valid, logits, tok, part, norm_w=nw, block_n=bn, block_k=16,
                   num_warps=4, persistent=per_sm, num_stages=stages, evict=evict)
    want_logits, want_tok = lm_head_argmax_ref(h, E, valid, norm_w=nw)
    if norm and dtype != torch.float32:
        # the reference rounds the norm's product in another order; the grid form (tested
        # against the reference on the model's shape on the GPU) is the oracle here
        want_logits = torch.empty_like(logits)
        grid_tok = torch.empty_like(tok)
        lm_head_argmax(h, E, valid, want_logits, grid_tok, part.clone(), norm_w=nw,
                       block_n=bn, block_k=16, num_warps=4, persistent=0)
        want_tok = int(grid_tok)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-4)
    assert int(tok) == want_tok == int(torch.argmax(logits[:valid]))
    assert (part[min(n // bn + (n % bn > 0), 4 * per_sm):] == 5).all()   # one key a program


def test_lm_head_argmax_persistent_lowest_id_on_ties_and_validation():
    g = torch.Generator().manual_seed(3)
    n, D = 40, 16
    h = torch.randn(D, generator=g).to(DEVICE)
    E = torch.randn(n, D, generator=g).to(DEVICE) * 0.1
    E[33] = E[21] = E[9] = h                 # the best rows, each in another program's block
    logits = torch.empty(n, device=DEVICE)
    tok = torch.empty(1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(n, 4), device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, n, logits, tok, part, block_n=4, block_k=16, num_warps=4,
                   persistent=1, num_stages=2, evict=True)
    assert int(tok) == 9
    with pytest.raises(ValueError, match="persistent"):
        lm_head_argmax(h, E, n, logits, tok, part, block_n=4, block_k=16, num_warps=4,
                       persistent=-1)
    wide = torch.zeros(2, 8192, device=DEVICE)
    with pytest.raises(ValueError, match="whole rows"):
        lm_head_argmax(torch.zeros(8192, device=DEVICE), wide, 2, torch.empty(2, device=DEVICE),
                       tok, part, block_n=4, block_k=16, num_warps=4, persistent=1)


def test_sample_candidates_follow_the_settings():
    from tritonchat.kernels.sampling import sample_candidates, sample_plan
    assert sample_candidates(20, 0.8, 0.0, 256) == 64          # 2 x top_k, a power of two
    assert sample_candidates(1, 1.0, 0.0, 256) == 32            # at least 32
    assert sample_candidates(200, 1.0, 0.0, 256) == 256         # at most the cap
    assert sample_candidates(0, 0.9, 0.0, 256) == 256           # top-p alone: the whole cap
    assert sample_candidates(0, 1.0, 0.05, 256) == 256          # min-p alone: the whole cap
    assert sample_candidates(0, 1.0, 0.0, 256) == 32            # plain temperature (Gumbel)
    assert sample_candidates(5, 1.0, 0.0, 16) == 16
    # the scratch sized for the cap serves every smaller count
    need = sample_scratch_numel(248320, 256)
    assert all(sample_plan(248320, kc)["scratch_numel"] <= need for kc in (16, 32, 64, 128, 256))


# ------------------------------------------------------------------------------------------
# sampler
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("settings,n_draws", [
    (dict(temperature=0.8, top_k=5), 1),                  # candidates, merge levels
    pytest.param(dict(temperature=0.8, top_k=0, top_p=0.7), 3,   # candidates, several draws
                 marks=pytest.mark.slow),
    (dict(temperature=0.8, top_k=0), 2),                  # Gumbel-max over the whole vocab
    pytest.param(dict(temperature=0.0, repetition_penalty=1.5), 1,   # greedy, the sampler
                 marks=pytest.mark.slow),
])
def test_sample_counts_and_advances_in_its_own_launch(settings, n_draws):
    # count / pos / ring in the draw's launch: the same draws as without them, the first token
    # counted in the generated row, written to the ring at the old position, pos + 1
    g = torch.Generator().manual_seed(3)
    vocab, valid = 3000, 2990
    logits = (torch.randn(vocab, generator=g) * 3).to(DEVICE)
    params = torch.tensor(params_from_sampling(SamplingParams(**settings)), device=DEVICE)
    got = []
    for fused in (False, True):
        counts = build_counts([5, 6, 6], [7], vocab, DEVICE)
        seed = torch.tensor([11, 4], device=DEVICE, dtype=torch.int64)
        tok = torch.full((n_draws,), -1, device=DEVICE, dtype=torch.int64)
        pos = torch.tensor([10], device=DEVICE, dtype=torch.int64)
        ring = torch.zeros(4, device=DEVICE, dtype=torch.int64)
        scratch = torch.zeros(sample_scratch_numel(vocab, 32, n_draws, merge_chunk=64),
                              device=DEVICE, dtype=torch.int64)
        kw = dict(count=True, pos=pos, ring=ring) if fused else {}
        sample_from_logits(logits, params, counts, seed, tok, scratch, valid_vocab=valid,
                           top_k_max=32, merge_chunk=64, **kw)
        got.append((tok.tolist(), counts.cpu(), int(pos), ring.tolist(), seed.tolist()))
    (tok, counts, pos, ring, seed), (tok0, counts0, pos0, ring0, seed0) = got[1], got[0]
    assert tok == tok0 and seed == seed0 and pos0 == 10 and ring0 == [0, 0, 0, 0]
    want = counts0.clone()
    want[1, tok[0]] += 1                                  # only the first draw is counted
    assert torch.equal(counts, want)
    assert pos == 11 and ring == [0, 0, tok[0], 0]        # position 10 -> slot 10 % 4


def test_sample_count_args_validate():
    logits = torch.zeros(V, device=DEVICE)
    counts = torch.zeros(2, V, device=DEVICE, dtype=torch.int32)
    params = torch.tensor(params_list(greedy=True), device=DEVICE)
    so = torch.tensor([1, 0], device=DEVICE, dtype=torch.int64)
    tok = torch.zeros(1, device=DEVICE, dtype=torch.int64)
    pos = torch.tensor([7], device=DEVICE, dtype=torch.int32)
    scratch = torch.zeros(sample_scratch_numel(V, 32), device=DEVICE, dtype=torch.int64)
    kw = dict(valid_vocab=V, top_k_max=32)
    with pytest.raises(ValueError, match="int64"):
        sample_from_logits(logits, params, counts, so, tok, scratch, pos=pos,
                           ring=torch.zeros(3, device=DEVICE, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="pass pos"):
        sample_from_logits(logits, params, counts, so, tok, scratch,
                           ring=torch.zeros(3, device=DEVICE, dtype=torch.int64), **kw)
    with pytest.raises(ValueError, match="one-element"):
        sample_from_logits(logits, params, counts, so, tok, scratch,
                           pos=torch.zeros(2, device=DEVICE, dtype=torch.int64), **kw)


def _logits(seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * scale).to(DEVICE)


def _counts(two_rows=True):
    c = torch.zeros(2, V, dtype=torch.int32)
    c[0, [1, 2, 5, 9, 44, 47]] = 1           # context (prompt) tokens, one of them padding
    c[1, [2, 3, 5, 6]] = torch.tensor([1, 3, 1, 2], dtype=torch.int32)   # generated tokens
    return (c if two_rows else c.sum(0).to(torch.int32)).contiguous().to(DEVICE)


def _sample(logits, params, counts, n, top_k_max, seed=1234, step=0, **kw):
    p = sample_plan(V, top_k_max, n, **kw)
    scratch = torch.full((p["scratch_numel"],), 7, device=DEVICE, dtype=torch.int64)
    so = torch.tensor([seed, step], device=DEVICE, dtype=torch.int64)
    out = torch.full((n,), -1, device=DEVICE, dtype=torch.int64)
    sample_from_logits(logits, torch.tensor(params, device=DEVICE, dtype=torch.float32),
                       counts, so, out, scratch, valid_vocab=VALID, top_k_max=top_k_max, **kw)
    return out.cpu(), so.cpu()


def _assert_distribution(tokens, probs):
    """Support and chi-square of the empirical histogram against the reference probabilities.
    The seeds are fixed, so this is deterministic; the bound is ~6 sigma of a chi-square."""
    n = tokens.numel()
    emp = torch.bincount(tokens, minlength=V).double()
    assert emp[probs == 0].sum() == 0, "drew a token the reference gives zero probability"
    assert bool((emp[probs >= 0.01] > 0).all()), "a likely token was never drawn"
    live = probs > 0
    dof = int(live.sum()) - 1
    if dof == 0:
        return
    expected = probs[live] * n
    chi2 = float(((emp[live] - expected) ** 2 / expected).sum())
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} for {dof} dof"


CASES = [  # (params, top_k_max, plan overrides)
    (params_list(1.0, 0, 1.0, 0.0, 0.5, 1.3), 16, {}),                  # Gumbel path, penalties
    (params_list(0.7, 5, 1.0, 0.0, 0.5, 1.3), 16, {}),                  # top-k
    (params_list(1.0, 0, 0.8, 0.0, 0.0, 1.0), 64, {}),                  # top-p, cap >= vocab
    (params_list(1.2, 10, 1.0, 0.2, 0.0, 1.0), 16, {}),                 # top-k + min-p
    (params_list(1.0, 10, 0.9, 0.05, 1.0, 1.1), 8, dict(block_v=8, merge_chunk=16)),  # merges
    (params_list(0.8, 6, 0.95, 0.0, 0.4, 1.2), 8, dict(block_v=8, merge_chunk=64)),   # 7 runs, final
    (params_list(1.0, 40, 1.0, 0.0, 0.0, 1.0), 16, {}),                 # top_k > cap: clamped
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sample_distribution(case):
    params, kmax, kw = CASES[case]
    logits, counts = _logits(case), _counts()
    tokens, so = _sample(logits, params, counts, 3000, kmax, seed=100 + case, **kw)
    assert int(so[1]) == 3000                          # one step per draw
    probs = sample_from_logits_ref(logits.cpu(), params, counts.cpu(), valid_vocab=VALID,
                                   top_k_max=kmax)
    _assert_distribution(tokens, probs)


@pytest.mark.parametrize("kc,block_v,chunk", [
    (8, 16, 16),      # 2 runs a merge group, one level
    pytest.param(8, 8, 32, marks=pytest.mark.slow),  # 4 runs, block = candidates
    pytest.param(4, 8, 32, marks=pytest.mark.slow),  # 8 runs, two levels, a ragged last group
    pytest.param(4, 4, 64, marks=pytest.mark.slow),  # 16 runs
    (2, 4, 64),       # 32 runs
    (2, 4, 128),      # 64 runs (the most a merge program takes)
    (16, 32, 64),     # 4 runs of 16
])
def test_sampler_candidates_are_the_top_keys(kc, block_v, chunk):
    # the candidates the final kernel receives hold exactly the kc best processed logits
    # (value, then lower id): ties on purpose, a vocab that leaves ragged blocks and groups
    from tritonchat.kernels.sampling import KEY_EMPTY
    v2, valid2 = 997, 990
    g = torch.Generator().manual_seed(kc * 1000 + chunk)
    logits = torch.randint(-40, 40, (v2,), generator=g).float().div(8).to(DEVICE)   # many ties
    counts = torch.zeros(2, v2, dtype=torch.int32)
    counts[0, :300:7] = 1
    counts[1, 5:200:11] = 2
    counts = counts.to(DEVICE)
    params = params_list(1.0, kc, 1.0, 0.0, 0.3, 1.2)
    p = sample_plan(v2, kc, 1, block_v=block_v, merge_chunk=chunk)
    assert p["levels"], "the plan must exercise the merge kernel"
    scratch = torch.full((p["scratch_numel"],), 7, device=DEVICE, dtype=torch.int64)
    out = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    so = torch.tensor([1, 0], device=DEVICE, dtype=torch.int64)
    sample_from_logits(logits, torch.tensor(params, device=DEVICE, dtype=torch.float32), counts,
                       so, out, scratch, valid_vocab=valid2, top_k_max=kc, block_v=block_v,
                       merge_chunk=chunk)
    keys = scratch[p["final_off"]:p["final_off"] + p["n_final"]].cpu()
    keys = keys[keys != KEY_EMPTY]
    best = torch.sort(keys, descending=True).values[:kc]
    ids = (4294967295 - (best & 4294967295)).tolist()
    l = penalized_logits_ref(logits.cpu(), params, counts.cpu(), valid2)
    order = sorted(range(valid2), key=lambda i: (-float(l[i]), i))[:kc]
    assert ids == order


def test_sample_top_p_boundary_and_tie_order():
    # four equal logits: P = 1/4 each, exactly, so the mass ranked above rank i is exactly
    # i/4. top_p = 0.5 keeps ranks 0 and 1 (strict <), and equal logits rank by lower id.
    logits = torch.full((V,), -1e4, device=DEVICE)
    logits[[7, 3, 30, 12]] = 0.0
    none = torch.zeros(V, device=DEVICE, dtype=torch.int32)
    params = params_list(1.0, 0, 0.5, 0.0)
    tokens, _ = _sample(logits, params, none, 2000, 16, seed=3)
    assert set(tokens.tolist()) == {3, 7}
    probs = sample_from_logits_ref(logits.cpu(), params, none.cpu(), valid_vocab=VALID,
                                   top_k_max=16)
    assert probs[3] == probs[7] == 0.5
    _assert_distribution(tokens, probs)


def test_sample_one_row_counts():
    # counts [V]: the whole history feeds both penalties
    params = params_list(0.9, 8, 0.95, 0.0, 0.7, 1.4)
    logits, counts = _logits(11), _counts(two_rows=False)
    tokens, _ = _sample(logits, params, counts, 3000, 16, seed=5)
    _assert_distribution(tokens, sample_from_logits_ref(logits.cpu(), params, counts.cpu(),
                                                        valid_vocab=VALID, top_k_max=16))


@pytest.mark.parametrize("params", [
    params_list(1.0, 20, 0.9, 0.0, 0.5, 1.3, greedy=True),
    params_list(0.0, 0, 1.0, 0.0, 2.0, 1.0),             # temperature 0 means greedy
    params_list(-1.0, 5, 0.5, 0.3, 0.0, 2.0),
])
@pytest.mark.parametrize("two_rows", [True, False])
def test_sample_greedy_is_penalized_argmax(params, two_rows):
    for seed in range(3):
        logits, counts = _logits(20 + seed, scale=0.5), _counts(two_rows)
        tokens, _ = _sample(logits, params, counts, 2, 16, seed=seed)
        want = int(torch.argmax(penalized_logits_ref(logits.cpu(), params, counts.cpu(), VALID)))
        assert tokens.tolist() == [want, want]


def test_sample_never_picks_padding():
    logits = _logits(3)
    logits[VALID:] = 100.0
    for params in (params_list(1.0, 0, 1.0, 0.0), params_list(1.0, 3, 0.9, 0.0),
                   params_list(greedy=True)):
        tokens, _ = _sample(logits, params, _counts(), 200, 16)
        assert int(tokens.max()) < VALID


def test_sample_stream_is_reproducible_and_advances():
    logits, counts = _logits(4, scale=0.3), _counts()
    for params in (params_list(1.0, 0, 1.0, 0.0), params_list(1.0, 12, 0.95, 0.0)):
        a, so_a = _sample(logits, params, counts, 64, 16, seed=9, step=10)
        b, _ = _sample(logits, params, counts, 64, 16, seed=9, step=10)
        c, _ = _sample(logits, params, counts, 64, 16, seed=9, step=74)
        d, _ = _sample(logits, params, counts, 64, 16, seed=10, step=10)
        assert torch.equal(a, b) and int(so_a[1]) == 74 and int(so_a[0]) == 9
        assert not torch.equal(a, c) and not torch.equal(a, d)
        # draw i of a call is the single draw at step + i
        one, _ = _sample(logits, params, counts, 1, 16, seed=9, step=13)
        assert int(one[0]) == int(a[3])


def test_sample_validates():
    logits = _logits(0)
    out = torch.empty(1, device=DEVICE, dtype=torch.int64)
    so = torch.zeros(2, device=DEVICE, dtype=torch.int64)
    params = torch.tensor(params_list(), device=DEVICE)
    scratch = torch.empty(sample_scratch_numel(V, 16), device=DEVICE, dtype=torch.int64)
    with pytest.raises(ValueError):          # scratch too small
        sample_from_logits(logits, params, _counts(), so, out, scratch[:3], valid_vocab=VALID,
                           top_k_max=16)
    with pytest.raises(ValueError):          # counts of the wrong shape
        sample_from_logits(logits, params, _counts()[:, :10].contiguous(), so, out, scratch,
                           valid_vocab=VALID, top_k_max=16)
    with pytest.raises(ValueError):          # block_v below the candidate count
        sample_plan(V, 16, block_v=8)
    sample_plan(V, 4, block_v=8, merge_chunk=256)  # 64 runs of 4: the most a merge takes
    with pytest.raises(ValueError, match="64 times"):   # more runs than a merge program takes
        sample_plan(V, 4, block_v=8, merge_chunk=512)


# ------------------------------------------------------------------------------------------
# the reference's semantics on hand-made cases
# ------------------------------------------------------------------------------------------

def test_reference_semantics_by_hand():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.cat([p.log(), torch.full((V - 4,), -1e4)])
    none = torch.zeros(V, dtype=torch.int32)

    def dist(**kw):
        return sample_from_logits_ref(logits, params_list(**kw), none, valid_vocab=VALID,
                                      top_k_max=16)[:4]
    torch.testing.assert_close(dist(top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]).double())
    torch.testing.assert_close(dist(top_k=3), torch.tensor([0.5, 0.3, 0.15, 0]).double() / 0.95)
    torch.testing.assert_close(dist(min_p=0.35), torch.tensor([0.625, 0.375, 0, 0]).double())
    torch.testing.assert_close(dist(top_p=0.01), torch.tensor([1.0, 0, 0, 0]).double())
    # top-p over the renormalised top-k: in the top-2 (0.625, 0.375) top_p 0.6 keeps one
    torch.testing.assert_close(dist(top_k=2, top_p=0.6), torch.tensor([1.0, 0, 0, 0]).double())
    # repetition: positive logits divided, negative multiplied; presence: generated only
    c = torch.zeros(2, V, dtype=torch.int32)
    c[0, 0] = 1
    c[1, 1] = 1
    pen = penalized_logits_ref(torch.tensor([2.0, -2.0] + [0.0] * (V - 2)),
                               params_list(presence_penalty=0.5, repetition_penalty=2.0), c,
                               VALID)
    assert pen[0] == 1.0 and pen[1] == -4.5 and pen[2] == 0.0
    assert torch.isinf(pen[VALID:]).all()
    # top-k keeps every logit tied with the k-th
    tie = torch.tensor([3.0, 1.0, 1.0, 1.0] + [-1e4] * (V - 4))
    d = sample_from_logits_ref(tie, params_list(top_k=2), none, valid_vocab=VALID, top_k_max=16)
    assert (d[:4] > 0).all() and d[4:].sum() == 0


def test_build_counts_and_a_flat_counts_row():
    counts = build_counts([1, 1, 4], [2], V, device=DEVICE)
    assert counts.shape == (2, V) and int(counts[0, 1]) == 2 and int(counts[1, 2]) == 1
    assert int(counts.sum()) == 4 and counts.dtype == torch.int32
    # a [V] counts tensor (one history row): the drawn token is counted in it
    flat = torch.zeros(V, device=DEVICE, dtype=torch.int32)
    logits = torch.zeros(V, device=DEVICE)
    logits[7] = 5.0
    tok = torch.zeros(1, device=DEVICE, dtype=torch.int64)
    sample_from_logits(logits, torch.tensor(params_list(greedy=True), device=DEVICE), flat,
                       torch.tensor([1, 0], device=DEVICE, dtype=torch.int64), tok,
                       torch.zeros(sample_scratch_numel(V, 32), device=DEVICE, dtype=torch.int64),
                       valid_vocab=V, top_k_max=32, count=True)
    assert int(tok) == 7 and int(flat[7]) == 1 and int(flat.sum()) == 1


def test_params_from_sampling_params():
    sp = SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.05, presence_penalty=1.5,
                        repetition_penalty=1.1)
    assert params_from_sampling(sp) == pytest.approx([0.6, 20, 0.95, 0.05, 1.5, 1.1, 0.0])
    assert params_from_sampling(SamplingParams(temperature=0.0))[6] == 1.0


# ------------------------------------------------------------------------------------------
# GPU twins: the real vocabulary
# ------------------------------------------------------------------------------------------

REAL_V, REAL_VALID, REAL_D = 248320, 248077, 1024


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [None, dict(block_n=16, block_k=512, num_warps=4, persistent=0)],
                         ids=["table", "grid"])
def test_gpu_lm_head_argmax_model_shape(plan):
    # the table's plan (the persistent form) and the grid form, plain and with the final norm
    g = torch.Generator().manual_seed(0)
    h = torch.randn(REAL_D, generator=g).to(DEVICE, torch.bfloat16)
    nw = (torch.randn(REAL_D, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    E = (torch.randn(REAL_V, REAL_D, generator=g) * 0.05).to(DEVICE, torch.bfloat16)
    E[REAL_VALID:] = h * 0.5                          # padded rows with the largest logits
    E[REAL_VALID - 1] = E[7] = h * 0.3                # the best real rows, far apart: id 7 wins
    logits = torch.empty(REAL_V, device=DEVICE)
    tok = torch.empty(1, device=DEVICE, dtype=torch.int32)
    part = torch.empty(REAL_V, device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, REAL_VALID, logits, tok, part, **(plan or {}))
    want_logits, _ = lm_head_argmax_ref(h, E, REAL_VALID)
    torch.testing.assert_close(logits, want_logits, rtol=1e-3, atol=1e-3)
    assert int(tok) == int(torch.argmax(logits[:REAL_VALID])) == 7
    lm_head_argmax(h, E, REAL_VALID, logits, tok, part, norm_w=nw, **(plan or {}))
    want_logits, want_tok = lm_head_argmax_ref(h, E, REAL_VALID, norm_w=nw)
    torch.testing.assert_close(logits, want_logits, rtol=2e-2, atol=2e-2)
    assert int(tok) == int(torch.argmax(logits[:REAL_VALID]))


def _real_inputs(kmax, n):
    g = torch.Generator().manual_seed(kmax)
    logits = (torch.randn(REAL_V, generator=g) * 4).to(DEVICE)
    counts = torch.zeros(2, REAL_V, dtype=torch.int32)
    counts[0, torch.randint(0, REAL_VALID, (500,), generator=g)] = 1
    counts[1, torch.topk(logits.cpu(), 5).indices] = 1       # penalise some of the best
    scratch = torch.empty(sample_scratch_numel(REAL_V, kmax, n), device=DEVICE,
                          dtype=torch.int64)
    return logits, counts.to(DEVICE), scratch


def _expected_tv(probs, n):
    """E[total variation] of an n-draw histogram: per token E|X/n - p| is about
    sqrt(2p(1-p)/(pi n)) (normal approximation), never more than 2p."""
    p = probs[probs > 0]
    return 0.5 * float(torch.minimum((2 * p * (1 - p) / (math.pi * n)).sqrt(), 2 * p).sum())


@pytest.mark.gpu
@pytest.mark.parametrize("kmax", [64, 256, 1024])
def test_gpu_sampler_model_vocab(kmax):
    n = 20000
    logits, counts, scratch = _real_inputs(kmax, n)
    so = torch.tensor([77, 0], device=DEVICE, dtype=torch.int64)
    out = torch.empty(n, device=DEVICE, dtype=torch.int64)
    for ps in (params_list(1.0, 20, 0.95, 0.0, 1.5, 1.1),       # Qwen's recommended settings
               params_list(0.8, 0, 0.9, 0.02),                  # nucleus within the cap
               params_list(0.5, 0, 1.0, 0.0, 0.0, 1.0)):        # exact Gumbel over the vocab
        params = torch.tensor(ps, device=DEVICE)
        sample_from_logits(logits, params, counts, so, out, scratch, valid_vocab=REAL_VALID,
                           top_k_max=kmax)
        probs = sample_from_logits_ref(logits.cpu(), ps, counts.cpu(), valid_vocab=REAL_VALID,
                                       top_k_max=kmax)
        emp = torch.bincount(out.cpu(), minlength=REAL_V).double() / n
        assert emp[probs == 0].sum() == 0
        tv = 0.5 * float((emp - probs).abs().sum())
        assert tv < 2 * _expected_tv(probs, n) + 0.01, (ps, tv, _expected_tv(probs, n))
    greedy = torch.tensor(params_list(1.0, 20, 0.95, 0.0, 1.5, 1.1, greedy=True), device=DEVICE)
    sample_from_logits(logits, greedy, counts, so, out[:1], scratch, valid_vocab=REAL_VALID,
                       top_k_max=kmax)
    want = int(torch.argmax(penalized_logits_ref(logits.cpu(), params_list(1.0, 20, 0.95, 0.0,
                                                                           1.5, 1.1),
                                                 counts.cpu(), REAL_VALID)))
    assert int(out[0]) == want


@pytest.mark.gpu
def test_gpu_sampler_cuda_graph_reads_new_params():
    logits, counts, scratch = _real_inputs(256, 1)
    params = torch.tensor(params_list(greedy=True), device=DEVICE)
    so = torch.tensor([5, 0], device=DEVICE, dtype=torch.int64)
    tok = torch.zeros(1, device=DEVICE, dtype=torch.int32)

    def step():
        sample_from_logits(logits, params, counts, so, tok, scratch, valid_vocab=REAL_VALID,
                           top_k_max=256, count=True)

    step()                                               # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    before = counts.clone()
    graph.replay()
    torch.cuda.synchronize()
    greedy_tok = int(tok)
    want = int(torch.argmax(penalized_logits_ref(logits.cpu(), params_list(greedy=True),
                                                 before.cpu(), REAL_VALID)))
    assert greedy_tok == want and int(counts[1, want]) == int(before[1, want]) + 1
    params.copy_(torch.tensor(params_list(3.0, 0, 1.0, 0.0), device=DEVICE))   # no re-capture
    seen = set()
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        seen.add(int(tok))
    assert len(seen) > 1 and max(seen) < REAL_VALID
    assert int(so[1]) == 22


# LM head with the final norm fused
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_argmax_with_final_norm(dtype):
    g = torch.Generator().manual_seed(5)
    V, D, valid = 300, 72, 290
    h = vec(D, g, 3.0, dtype)
    norm_w = vec(D, g, 0.2, dtype)
    E = vec(V * D, g, 1.0, dtype).view(V, D)
    logits = torch.full((V,), float("nan"), device=DEVICE)
    tok = torch.full((1,), -1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(V, 16), device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, valid, logits, tok, part, norm_w=norm_w, eps=EPS, block_n=16,
                   block_k=32, num_warps=4)
    want_logits, want_tok = lm_head_argmax_ref(h, E, valid, norm_w=norm_w, eps=EPS)
    torch.testing.assert_close(logits, want_logits, **tol(dtype))
    assert int(tok[0]) == want_tok


# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_lm_head_final_norm_model_shape():
    dt = torch.bfloat16
    V, D = Q08["V"], Q08["D"]
    g = torch.Generator().manual_seed(6)
    h = vec(D, g, 2.0, dt)
    norm_w = vec(D, g, 0.2, dt)
    E = vec(V * D, g, 0.05, dt).view(V, D)
    from tritonchat.kernels.sampling import lm_head_plan
    p = lm_head_plan(V, D, True)
    logits = torch.empty(V, device=DEVICE)
    tok = torch.empty(1, device=DEVICE, dtype=torch.int64)
    part = torch.empty(lm_head_partials_numel(V, p["block_n"]), device=DEVICE, dtype=torch.int64)
    lm_head_argmax(h, E, V - 243, logits, tok, part, norm_w=norm_w, eps=EPS)
    want_logits, want_tok = lm_head_argmax_ref(h, E, V - 243, norm_w=norm_w, eps=EPS)
    torch.testing.assert_close(logits, want_logits, rtol=1e-3, atol=1e-3)
    assert want_logits[int(tok[0])] >= want_logits[:V - 243].max() - 1e-3
