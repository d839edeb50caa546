"""#61.7 probe: bf16 on grouped value heads (2 value heads per key head), on the GPU.

The issue: the Triton engine in bf16 disagreed with transformers at the first token in 2 of 6 cases
of such a checkpoint, where the fp32 top-2 gap is >= 0.5 (fp32 agrees everywhere). For each case
this compares the first-token logits of
    (a) our Triton engine in bf16, (b) transformers in bf16, (c) transformers in fp32,
prints the fp32 top-2 gap and whether (a) and (b) pick (c)'s token, and asserts that wherever the
gap is >= 0.5 our bf16 argmax equals transformers bf16's or fp32's. If (b) also misses (c) there,
the disagreement is bf16 rounding; if only (a) misses, our bf16 path has an error.

Run with -s on the device: pytest -s -m gpu tests/engine/test_bf16_grouped_heads.py
"""
import pytest
import torch

from tests.fixtures.checkpoints import load_hf_model, make_tiny_checkpoint

GROUPED = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)
CASES = [(seed, plen) for seed, plen in zip(range(6), (7, 16, 23, 40, 64, 97))]  # 6 seeds, various prompts
GAP = 0.5


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from tritonchat.engine.config import load_config
    from tritonchat.engine.options import EngineOptions
    from tritonchat.engine.triton_backend import TritonBackend
    from tritonchat.engine.weights import load_weights

    out = []
    for seed, plen in CASES:
        path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"grouped{seed}"), seed=seed, with_tokenizer=False,
                                    **GROUPED)
        cfg = load_config(path)
        assert cfg.linear_num_value_heads == 2 * cfg.linear_num_key_heads
        g = torch.Generator().manual_seed(1000 + seed)
        prompt = torch.randint(3, cfg.vocab_size - 3, (plen,), generator=g).tolist()
        ids = torch.tensor([prompt], device="cuda")
        tri = TritonBackend(cfg, load_weights(path, cfg, device="cuda", dtype=torch.bfloat16),
                            EngineOptions(backend="triton", device="cuda", dtype="bfloat16", max_context=256))
        tri.prefill(prompt)
        ours = tri.logits().float().cpu()
        tri.close()
        with torch.no_grad():
            hf16 = load_hf_model(path, dtype=torch.bfloat16).cuda()(input_ids=ids).logits[0, -1].float().cpu()
            hf32 = load_hf_model(path, dtype=torch.float32).cuda()(input_ids=ids).logits[0, -1].float().cpu()
        top2 = torch.topk(hf32, 2)
        out.append(dict(seed=seed, prompt_len=plen, gap=float(top2.values[0] - top2.values[1]),
                        fp32=int(top2.indices[0]), ours=int(ours.argmax()), hf_bf16=int(hf16.argmax()),
                        ours_err=float((ours - hf32).abs().max()), hf_bf16_err=float((hf16 - hf32).abs().max())))
    print("\nseed  T    fp32 gap  fp32 tok  ours(a) ok  hf bf16(b) ok  max|a-c|  max|b-c|")
    for r in out:
        print(f"{r['seed']:>4} {r['prompt_len']:>3}  {r['gap']:8.3f}  {r['fp32']:>8}  {r['ours']:>7} "
              f"{'y' if r['ours'] == r['fp32'] else 'N'}  {r['hf_bf16']:>10} {'y' if r['hf_bf16'] == r['fp32'] else 'N'}"
              f"  {r['ours_err']:8.4f}  {r['hf_bf16_err']:8.4f}")
    return out


@pytest.mark.gpu
def test_bf16_grouped_value_heads_first_token(rows):
    bad = [r for r in rows if r["gap"] >= GAP and r["ours"] not in (r["fp32"], r["hf_bf16"])]
    assert not bad, f"our bf16 argmax differs from both transformers bf16 and fp32 where the fp32 gap >= {GAP}: {bad}"


@pytest.mark.gpu
def test_bf16_grouped_value_heads_error_is_no_worse_than_transformers(rows):
    # Rounding shows as an error of the same size as transformers' own bf16 error; a bug as far more.
    for r in rows:
        assert r["ours_err"] <= 4 * r["hf_bf16_err"] + 0.05, r
