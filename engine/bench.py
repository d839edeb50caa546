"""`tritonchat bench`: decode speed against the HBM roofline, measured in the same run.

The roofline is the time to read, once, a buffer as large as the bytes one decode step must
move (all weights with the tied LM head read whole, the GDN recurrent states read and written,
the KV cache up to the position), at the faster of two measured read rates (torch.sum, and our
whole-row streaming read, ~8% faster on the H200); tok/s = bandwidth / bytes. Decode speed is
measured through the same generation loop the app uses (one host read of each token), greedy
with EOS ignored, and with --compare also with the model card's sampling and in every other
decode mode (options.decode_mode: the persistent step beside the per-operator one), whose greedy
tokens are compared with the first configuration's.
"""
from __future__ import annotations

import json
import sys
import statistics
import time
from dataclasses import replace
from typing import Optional

import torch

from .options import EngineOptions, SamplingParams, fields_by_name
from .errors import TritonChatError
from .profile_step import prefill_flops


def measure_hbm_read_methods(nbytes: int, device, reps: int = 20) -> dict:
    """Read bandwidth in GB/s of one pass over an nbytes buffer, by torch.sum and by our
    whole-row streaming read (kernels.bandwidth.read_rates_gb_s, which the tuner uses too)."""
    from tritonchat.kernels.bandwidth import read_rates_gb_s
    return read_rates_gb_s(nbytes, device, reps)


def measure_hbm_read(nbytes: int, device, reps: int = 20) -> float:
    """The HBM read rate the roofline uses (GB/s): the faster of measure_hbm_read_methods."""
    return max(measure_hbm_read_methods(nbytes, device, reps).values())


def _random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 240000), (n,), generator=g).tolist()


def _build(args, options: EngineOptions):
    from .config import qwen35_08b_config
    from .loader import load_backend, random_backend
    if args.model:
        cfg, be = load_backend(args.model, options)
    else:
        cfg = qwen35_08b_config()
        be = random_backend(cfg, options)
    return cfg, be


def decode_run(be, prompt: list[int], new_tokens: int, params: Optional[SamplingParams] = None) -> dict:
    """Prefill the prompt, then decode new_tokens (EOS ignored) through Generator: greedily, or
    with `params` (sampling)."""
    from .generation import Generator
    params = params or SamplingParams(greedy=True)
    gen = Generator(be, stop_ids=[])
    gen.snapshots_enabled = False
    # warm-up at the same length: compiles every kernel (prefill tiles depend on T) and captures
    # the graph outside the measurement
    gen.generate(prompt, params, max_new_tokens=4)
    gen.forget()
    torch.cuda.synchronize()
    res = gen.generate(prompt, params, max_new_tokens=new_tokens)
    s = res.stats
    out = {"decode_tok_s": s.decode_tok_s, "ms_per_token": s.decode_ms_per_token, "ttft_ms": s.ttft_ms,
           "prefill_tok_s": s.prefill_tok_s, "new_tokens": s.new_tokens, "token_ids": res.token_ids}
    graph = getattr(be, "_graph", None)
    if graph is not None and be.length + 2 * 64 < be.max_context:
        # GPU time of one step alone: graph replays back to back, no host read per token
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(64):
            graph.replay()
        torch.cuda.synchronize()
        out["gpu_step_ms"] = (time.perf_counter() - t0) * 1e3 / 64
    gen.forget()
    return out


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The index of the first token where two greedy runs part (a length counts), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_mode_runs(be, prompt: list[int], new_tokens: int, roof_tok_s: float, ref_tokens: list[int],
                     split_k: bool, graphs: tuple = (True, False)) -> list[dict]:
    """The decode step in each decode mode other than the one running (options.decode_mode:
    persistent beside per_op), with split-K as given and each graph setting of `graphs`: tok/s,
    the fraction of the roofline, and whether its greedy tokens equal `ref_tokens` (the first
    configuration's; where not, the first token that differs). A mode that cannot run here
    (the backend fell back: decode_mode_error) is one entry with its sentence under "error";
    the backend is left in the mode and configuration it came in."""
    home, home_graph = be.options.decode_mode, be.options.graph
    out = []
    for mode in fields_by_name()["decode_mode"].metadata["choices"]:
        if mode == home:
            continue
        be.configure(decode_mode=mode)
        if be.options.decode_mode != mode:
            out.append({"decode_mode": mode, "split_k": split_k,
                        "error": be.decode_mode_error or f"the {mode} decode step did not start"})
            be.configure(decode_mode=home)
            continue
        try:
            for graph in graphs:
                be.configure(split_k=split_k, graph=graph)
                r = decode_run(be, prompt, new_tokens)
                toks = r.pop("token_ids")
                r.update(decode_mode=mode, split_k=split_k, graph=be.options.graph,
                         fraction_of_roofline=r["decode_tok_s"] / roof_tok_s,
                         tokens_equal_first_config=toks == ref_tokens,
                         first_token_difference=first_difference(toks, ref_tokens))
                out.append(r)
        finally:
            be.configure(decode_mode=home, graph=home_graph)
    return out


def kernel_table(be, prompt: list[int], steps: int = 24) -> Optional[list[dict]]:
    """Per-kernel GPU time of eager, event-timed steps (separate from the speed measurement)."""
    if not hasattr(be, "configure"):
        return None
    be.configure(timing=True)
    be.timing_interval_s = 0.0                     # time every step of this pass
    be.reset()
    be.prefill(prompt)
    be.begin_sampling(SamplingParams(greedy=True), prompt)
    tok = be.sample()
    be.reset_timings()
    for _ in range(steps):
        tok = be.step(tok)
    rows = be.kernel_timings()
    be.configure(timing=False)
    be.timing_interval_s = 0.5
    return rows


SWEEP_POSITIONS = (2048, 8192)     # decode speed at these filled contexts too (--compare)


def decode_steps(be, tok: int, n: int) -> int:
    """n greedy decode steps from tok, run as the generator runs them (the app's path): the step
    after each one is queued on the device (launch_next) before the host reads that one's
    token, so the host's turnaround overlaps the GPU's work. Returns the last token."""
    be.launch_step(tok)
    for i in range(n):
        more = i + 1 < n
        ahead = more and be.launch_next()
        tok = be.finish_step()
        if more and not ahead:
            be.launch_step(tok)
    return tok


def long_context_run(be, cfg, position: int, new_tokens: int, hbm_gb_s: float) -> dict:
    """Decode speed with `position` tokens already in the KV cache (filled with random values:
    speed does not depend on them) against that position's own roofline (KV bytes included)."""
    st = be.state
    for k, v in st.kv.values():
        k[:, :position].normal_()
        v[:, :position].normal_()
    for t in st.rec.values():
        t.normal_().mul_(0.01)
    st.length = position
    be.pos_buf.fill_(position)
    be.h.normal_()
    be.mark_prefilled()
    be.begin_sampling(SamplingParams(greedy=True), [])
    tok = be.sample()
    tok = decode_steps(be, tok, 8)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    decode_steps(be, tok, new_tokens)
    dt = time.perf_counter() - t0
    mid = position + 8 + new_tokens // 2
    nbytes = cfg.decode_bytes_per_token(2, context=mid)
    roof = hbm_gb_s * 1e9 / nbytes
    tok_s = new_tokens / dt
    return {"position": position, "decode_tok_s": tok_s, "roofline_tok_s": roof, "fraction_of_roofline": tok_s / roof,
            "bytes_per_token": nbytes}


_SYNTH_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def synthetic_tokenizer_dir(path, vocab: int):
    """A word-level tokenizer covering every id of the vocabulary (random weights produce any id),
    with ChatML specials, so the app's ChatSession (detokenizer, thinking split, text batching,
    stats) can be measured on random weights."""
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers import AddedToken
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = {f"w{i}": i for i in range(vocab - len(specials) - 1)}
    words["[UNK]"] = len(words)
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": _SYNTH_TEMPLATE}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": []}))
    return path


def session_run(be, cfg, prompt_len: int, new_tokens: int) -> dict:
    """Decode speed through the app's Qt-free ChatSession with text batching (30 ms) and stats
    (10 Hz) callbacks on, as the desktop app runs it."""
    import tempfile
    import threading

    from .session import ChatSession
    from .tokenizer import ChatTokenizer
    with tempfile.TemporaryDirectory() as d:
        tok = ChatTokenizer.from_dir(synthetic_tokenizer_dir(d, cfg.vocab_size))
    session = ChatSession(be, tok)
    words = " ".join(f"w{i}" for i in _random_prompt(prompt_len, cfg.vocab_size - 8))
    msgs = [{"role": "user", "content": words}]
    counters = {"text": 0, "stats": 0}

    def on_text(th, an):
        counters["text"] += 1

    def on_stats(d):
        counters["stats"] += 1

    p = SamplingParams(greedy=True)
    session.generate(msgs, p, max_new_tokens=8, enable_thinking=False, ignore_eos=True)
    session.reset()
    reply = session.generate(msgs, p, max_new_tokens=new_tokens, enable_thinking=False, ignore_eos=True,
                             stop_event=threading.Event(), on_text=on_text, on_stats=on_stats)
    s = reply.result.stats
    return {"decode_tok_s": s.decode_tok_s, "ttft_ms": s.ttft_ms, "new_tokens": s.new_tokens,
            "text_batches": counters["text"], "stats_updates": counters["stats"]}


def transformers_run(cfg, prompt: list[int], new_tokens: int, prefill_lens: list[int]) -> Optional[dict]:
    """Hugging Face transformers eager on random weights of the same shape (when importable)."""
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    except Exception as e:
        return {"error": f"transformers not importable: {e}"}
    hf_cfg = Qwen3_5TextConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        layer_types=list(cfg.layer_types), vocab_size=cfg.vocab_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
        linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
        linear_conv_kernel_dim=cfg.linear_conv_kernel_dim, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta,
                             partial_rotary_factor=cfg.partial_rotary_factor))
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    out = {"attn_implementation": "eager"}
    model.config._attn_implementation = "eager"
    ids = torch.tensor([prompt], device="cuda")
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ttft = t1 - t0
        out["ttft_ms"] = ttft * 1e3
        out["decode_tok_s"] = new_tokens / max((t2 - t1) - ttft, 1e-9)
        pre = {}
        for n in prefill_lens:
            p = torch.tensor([_random_prompt(n, cfg.vocab_size, n)], device="cuda")
            try:
                model(input_ids=p[:, :16], logits_to_keep=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(input_ids=p, logits_to_keep=1)
                torch.cuda.synchronize()
                pre[str(n)] = {"ttft_ms": (time.perf_counter() - t0) * 1e3}
            except torch.cuda.OutOfMemoryError:
                pre[str(n)] = {"error": "out of memory"}
                torch.cuda.empty_cache()
        out["prefill"] = pre
    del model
    torch.cuda.empty_cache()
    return out


def prefill_table(be, cfg, lens: list[int], repeats: int = 5) -> dict:
    """TTFT (prefill + first token) for several prompt lengths: the median of `repeats` runs
    after a warm-up run (each from an empty cache), and every run's time."""
    out = {}
    for n in lens:
        if n >= be.max_context:
            out[str(n)] = {"error": f"exceeds the context ({be.max_context})"}
            continue
        prompt = _random_prompt(n, cfg.vocab_size, n)
        try:
            be.reset()
            be.prefill(prompt)                 # warm-up: compile for this length
            be.begin_sampling(SamplingParams(greedy=True), [])
            be.sample()
            runs = []
            for _ in range(repeats):           # the median: one run can catch a host hiccup
                be.reset()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                be.prefill(prompt)
                be.sample()
                runs.append(time.perf_counter() - t0)
            dt = statistics.median(runs)
            out[str(n)] = {"ttft_ms": dt * 1e3, "prefill_tok_s": n / dt,
                           "tflop_s": sum(prefill_flops(cfg, n).values()) / dt / 1e12,
                           "ttft_ms_runs": [round(r * 1e3, 3) for r in runs]}
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            out[str(n)] = {"error": "out of memory"}
    be.reset()
    return out


def run_bench(args, options: EngineOptions) -> int:
    """The bench of `tritonchat bench`: `options` from its flags, args for the rest."""
    if not options.device.startswith("cuda") or not torch.cuda.is_available():
        raise TritonChatError("The bench needs a CUDA GPU (it measures GPU decode speed against HBM bandwidth).")
    if not args.model and not args.random_weights:
        args.random_weights = True
    lens = [int(x) for x in (args.prefill_lens or "128,2048,8192,32768").split(",") if x]
    # the TTFT table's longest prompt must fit with room for its first token
    context = args.context or (max(32768, max(lens) + 512) if args.compare else 32768)
    options = replace(options, max_context=context)
    prompt_len, new_tokens = args.prompt_len, args.new_tokens
    if prompt_len < 1 or new_tokens < 2:
        raise TritonChatError("--prompt-len must be >= 1 and --new-tokens >= 2.")
    if prompt_len + new_tokens + 16 > context:
        raise TritonChatError(f"--prompt-len + --new-tokens must fit the context ({context}).")
    gpu = torch.cuda.get_device_name(0)
    configs = [(options.split_k, options.graph)]
    if args.compare:
        configs = [(True, True), (False, True), (True, False), (False, False)]
    cfg, be = _build(args, replace(options, split_k=configs[0][0], graph=configs[0][1]))
    prompt = _random_prompt(prompt_len, cfg.vocab_size)
    nbytes = cfg.decode_bytes_per_token(2 if options.dtype != "float32" else 4, context=prompt_len + new_tokens // 2)
    methods = measure_hbm_read_methods(nbytes, be.device)
    hbm = max(methods.values())
    roof_tok_s = hbm * 1e9 / nbytes
    report = {"gpu": gpu, "backend": be.name, "dtype": options.dtype, "weights": args.model or "random (true 0.8B shape)",
              "prompt_len": prompt_len, "new_tokens": new_tokens, "context": context,
              "roofline": {"hbm_read_gb_s": hbm, "hbm_read_methods_gb_s": methods, "bytes_per_token": nbytes,
                           "floor_ms": nbytes / hbm / 1e6, "tok_s": roof_tok_s}}
    if be.name == "triton":
        # positions where the decode step changes plans (one captured graph per range)
        report["context_range_bounds"] = be.context_range_bounds
        # "split-K: no shape splits on this GPU" where split-K on and off run the same step
        report["split_k_note"] = be.split_k_note
    report["decode_mode"] = be.options.decode_mode
    if getattr(be, "decode_mode_error", None):           # the mode asked for fell back at build
        report["decode_mode_error"] = be.decode_mode_error
    runs = []
    ref_tokens = None
    for split_k, graph in configs:
        be.configure(split_k=split_k, graph=graph)
        r = decode_run(be, prompt, new_tokens)
        r.update(split_k=split_k, graph=graph, fraction_of_roofline=r["decode_tok_s"] / roof_tok_s)
        if be.name == "triton":                  # kernels of its graph with the L2 window on them
            r["l2_state_nodes"] = be.l2_state_nodes if graph else 0
            # graph off: whether the steps replayed their recorded launches (engine/launch_replay.py)
            r["launch_replay"] = bool(be.launch_replay_active)
        toks = r.pop("token_ids")
        if ref_tokens is None:
            ref_tokens = toks
        r["tokens_equal_first_config"] = toks == ref_tokens
        runs.append(r)
        print(f"split-K {'on ' if split_k else 'off'} graph {'on ' if graph else 'off'}: "
              f"{r['decode_tok_s']:8.1f} tok/s  {r['ms_per_token']:.3f} ms/token  "
              f"{100 * r['fraction_of_roofline']:.1f}% of roofline  TTFT {r['ttft_ms']:.1f} ms", file=sys.stderr)
    report["runs"] = runs
    report.update({k: runs[0][k] for k in ("decode_tok_s", "ms_per_token", "ttft_ms", "fraction_of_roofline")})
    be.configure(split_k=configs[0][0], graph=configs[0][1])
    if args.compare and be.name == "triton":
        # the other decode mode (issue #59: the persistent step), graph on and off
        report["decode_mode_runs"] = decode_mode_runs(be, prompt, new_tokens, roof_tok_s, ref_tokens,
                                                      split_k=configs[0][0])
        for r in report["decode_mode_runs"]:
            print(_decode_mode_line(r), file=sys.stderr)
        ran = [r for r in report["decode_mode_runs"] if "error" not in r and r["graph"] == configs[0][1]]
        report["decode_mode_speedup"] = {r["decode_mode"]: r["decode_tok_s"] / runs[0]["decode_tok_s"]
                                         for r in ran}
        if ran:
            # per-operator time inside the other mode's step, from its timer stamps
            home, mode = be.options.decode_mode, ran[0]["decode_mode"]
            be.configure(decode_mode=mode)
            try:
                report["kernels_" + mode] = kernel_table(be, prompt)
            except Exception as e:       # said in the report; the comparison above stands
                report["kernels_" + mode + "_error"] = f"{type(e).__name__}: {e}"
                print(f"{mode} step's operator table failed: {e}", file=sys.stderr)
                be.configure(timing=False)
            be.configure(decode_mode=home, split_k=configs[0][0], graph=configs[0][1])
    if args.compare and be.name == "triton" and configs[0][1]:
        # the first configuration again with the GDN states' L2 window switched (engine/l2_state.py)
        on = be.options.l2_state
        be.configure(l2_state=not on)
        r = decode_run(be, prompt, new_tokens)
        r_nodes = be.l2_state_nodes
        be.configure(l2_state=on)
        same = r.pop("token_ids") == ref_tokens
        r = {k: r[k] for k in ("decode_tok_s", "ms_per_token", "gpu_step_ms") if k in r}
        r.update(l2_state=not on, l2_state_nodes=r_nodes, tokens_equal_first_config=same)
        report["l2_state_switched"] = r
        off, on_tok_s = (r["decode_tok_s"], runs[0]["decode_tok_s"]) if on else (runs[0]["decode_tok_s"], r["decode_tok_s"])
        report["l2_state_speedup"] = on_tok_s / off
        print(f"GDN states in L2 {'off' if on else 'on'}: {r['decode_tok_s']:.1f} tok/s "
              f"(on / off {report['l2_state_speedup']:.3f}x)", file=sys.stderr)
        if be.context_range_bounds:
            # and with the table's base plans at every position (one graph instead of one per
            # context range; the ranges' plans sum in another order, so tokens may differ)
            be.set_context_ranges(False)
            r = decode_run(be, prompt, new_tokens)
            be.set_context_ranges(True)
            same = r.pop("token_ids") == ref_tokens
            r = {k: r[k] for k in ("decode_tok_s", "ms_per_token", "gpu_step_ms") if k in r}
            report["context_ranges_switched"] = dict(r, context_ranges=False,
                                                     tokens_equal_first_config=same)
            report["context_ranges_speedup"] = runs[0]["decode_tok_s"] / r["decode_tok_s"]
            print(f"context ranges off (one graph): {r['decode_tok_s']:.1f} tok/s (on / off "
                  f"{report['context_ranges_speedup']:.3f}x)", file=sys.stderr)
    if args.compare and be.name == "triton":
        # the graph-off step with the launch cache switched: every launch through our wrappers
        # and Triton's dispatch (cache off), or replayed (on)
        on = be.options.launch_cache
        be.configure(split_k=configs[0][0], graph=False, launch_cache=not on)
        r = decode_run(be, prompt, new_tokens)
        r_replay = bool(be.launch_replay_active)
        be.configure(graph=configs[0][1], launch_cache=on)
        same = r.pop("token_ids") == ref_tokens
        r = {k: r[k] for k in ("decode_tok_s", "ms_per_token") if k in r}
        r.update(split_k=configs[0][0], graph=False, launch_cache=not on, launch_replay=r_replay,
                 tokens_equal_first_config=same)
        report["launch_cache_switched"] = r
        eager = next(x["decode_tok_s"] for x in runs if x["split_k"] == configs[0][0] and not x["graph"])
        report["launch_cache_speedup"] = (eager / r["decode_tok_s"]) if on else (r["decode_tok_s"] / eager)
        print(f"graph off, launch cache {'off' if on else 'on'}: {r['decode_tok_s']:.1f} tok/s "
              f"(on / off {report['launch_cache_speedup']:.2f}x)", file=sys.stderr)
    report["kernels"] = kernel_table(be, prompt)
    mem = be.memory_info()
    report["gpu_memory"] = {"allocated_gib": mem.get("allocated_bytes", 0) / 2**30,
                            "reserved_gib": mem.get("reserved_bytes", 0) / 2**30,
                            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if args.compare:
        be.configure(split_k=configs[0][0], graph=configs[0][1])
        report["session"] = session_run(be, cfg, prompt_len, new_tokens)
        report["session"]["vs_bench"] = report["session"]["decode_tok_s"] / report["decode_tok_s"]
        # what a chat decodes with: the model card's sampling (the app's default settings)
        from .session import sampling_defaults
        sp = sampling_defaults({})
        r = decode_run(be, prompt, new_tokens, sp)
        r.pop("token_ids")
        report["sampled"] = dict(r, settings={k: getattr(sp, k) for k in ("temperature", "top_k", "top_p", "min_p")},
                                 vs_greedy=r["decode_tok_s"] / report["decode_tok_s"])
        print(f"sampled ({report['sampled']['settings']}): {r['decode_tok_s']:.1f} tok/s, "
              f"{100 * report['sampled']['vs_greedy']:.1f}% of greedy", file=sys.stderr)
        if be.name == "triton":
            pos = context - new_tokens - 64
            report["long_context"] = long_context_run(be, cfg, pos, min(new_tokens, 256), hbm)
            if any(b <= pos for b in be.context_range_bounds):
                # the same with the table's base plans (the long contexts' range off)
                be.set_context_ranges(False)
                off = long_context_run(be, cfg, pos, min(new_tokens, 256), hbm)
                be.set_context_ranges(True)
                report["long_context_ranges_off"] = off
                report["long_context_ranges_speedup"] = (report["long_context"]["decode_tok_s"]
                                                         / off["decode_tok_s"])
                print(f"position {pos}: context ranges on / off "
                      f"{report['long_context_ranges_speedup']:.3f}x", file=sys.stderr)
            # the contexts a chat spends most of its time in, each against its own roofline
            report["context_sweep"] = [long_context_run(be, cfg, p, min(new_tokens, 128), hbm)
                                       for p in SWEEP_POSITIONS if p < pos]
            be.reset()
        graphed = be.options.prefill_graph
        be.configure(prefill_graph=False)        # the plain launches first, then the graphs
        report["prefill"] = prefill_table(be, cfg, [n for n in lens if n < context])
        print("TTFT (median of 5): " + ", ".join(
            f"{n} tok {v['ttft_ms']:.1f} ms ({v['tflop_s']:.0f} TFLOP/s)" for n, v in report["prefill"].items() if "ttft_ms" in v),
            file=sys.stderr)
        if be.name == "triton":
            # the same prompts through the prefill CUDA graphs (the warm-up run of each length
            # captures its bucket's graph; the measured runs replay it)
            from .triton_prefill import GRAPH_MAX_T
            be.configure(prefill_graph=True)
            report["prefill_graphed"] = prefill_table(be, cfg, [n for n in lens if n <= GRAPH_MAX_T])
            print("TTFT with prefill graphs (median of 5): " + ", ".join(
                f"{n} tok {v['ttft_ms']:.1f} ms ({v['tflop_s']:.0f} TFLOP/s)" for n, v in report["prefill_graphed"].items()
                if "ttft_ms" in v), file=sys.stderr)
        be.configure(prefill_graph=graphed)
        be.close()
        del be
        torch.cuda.empty_cache()
        report["transformers"] = transformers_run(cfg, prompt, min(new_tokens, 64), [n for n in lens if n <= 8192])
        t = report["transformers"]
        if t and "decode_tok_s" in t:
            report["ours_vs_transformers"] = report["decode_tok_s"] / t["decode_tok_s"]
        g = {(r["split_k"], r["graph"]): r["decode_tok_s"] for r in runs}
        report["graph_speedup"] = g[(True, True)] / g[(True, False)]
        lc = report.get("launch_cache_switched")
        if lc and lc["launch_cache"] is False and configs[0][0]:
            # the graph against eager launches through Triton's dispatch, as before the cache
            report["graph_speedup_vs_dispatch"] = g[(True, True)] / lc["decode_tok_s"]
        report["split_k_speedup"] = g[(True, True)] / g[(False, True)]
        if args.plot:
            write_plot(report, args.plot)
    if not args.json:
        _print_table(report)
    else:
        print(json.dumps(report))
    return 0


def _decode_mode_line(r: dict) -> str:
    if "error" in r:
        return f"  decode {r['decode_mode']}: did not run: {r['error']}"
    same = "equal" if r["tokens_equal_first_config"] else f"differ from token {r['first_token_difference']}"
    return (f"  decode {r['decode_mode']} split-K {'on ' if r['split_k'] else 'off'} graph "
            f"{'on ' if r['graph'] else 'off'}: {r['decode_tok_s']:.1f} tok/s, {r['ms_per_token']:.3f} ms/token, "
            f"{100 * r['fraction_of_roofline']:.1f}% of roofline, greedy tokens {same}")


def _print_kernels(rows: list[dict], title: str = "kernel") -> None:
    print(f"{title:28s} {'launches':>8s} {'us/token':>9s} {'share':>6s} {'GB/s':>7s}")
    for k in rows:
        print(f"{k['name']:28s} {k['launches_per_token']:8.1f} {k['us_per_token']:9.1f} "
              f"{100 * k['share']:5.1f}% {k['gb_s']:7.0f}")


def _print_table(report: dict) -> None:
    r = report["roofline"]
    print(f"GPU: {report['gpu']}   backend {report['backend']} {report['dtype']}   weights: {report['weights']}")
    print(f"roofline: {r['hbm_read_gb_s']:.0f} GB/s read, {r['bytes_per_token'] / 1e9:.3f} GB/token -> "
          f"{r['floor_ms']:.3f} ms/token = {r['tok_s']:.0f} tok/s")
    if r.get("hbm_read_methods_gb_s"):
        print("  read rates: " + ", ".join(f"{k} {v:.0f} GB/s" for k, v in r["hbm_read_methods_gb_s"].items())
              + " (the roofline takes the fastest)")
    if report.get("decode_mode"):
        print(f"decode step: {report['decode_mode']}" + (f" ({report['decode_mode_error']})"
                                                         if report.get("decode_mode_error") else ""))
    for run in report["runs"]:
        print(f"  split-K {'on ' if run['split_k'] else 'off'} graph {'on ' if run['graph'] else 'off'}: "
              f"{run['decode_tok_s']:.1f} tok/s, {run['ms_per_token']:.3f} ms/token, "
              f"{100 * run['fraction_of_roofline']:.1f}% of roofline, TTFT {run['ttft_ms']:.1f} ms")
    for run in report.get("decode_mode_runs", []):
        print(_decode_mode_line(run))
    m = report["gpu_memory"]
    print(f"GPU memory: {m['allocated_gib']:.2f} GiB allocated, peak {m['peak_gib']:.2f} GiB")
    if report.get("kernels"):
        _print_kernels(report["kernels"])
    for mode in fields_by_name()["decode_mode"].metadata["choices"]:
        if report.get("kernels_" + mode):
            _print_kernels(report["kernels_" + mode], f"operator ({mode} step)")
    for key in ("l2_state_switched", "context_ranges_switched", "launch_cache_switched", "sampled",
                "long_context",
                "long_context_ranges_off", "context_sweep", "prefill", "transformers"):
        if key in report:
            print(f"{key}: {json.dumps(report[key])}")


def write_plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = report["runs"]
    labels = [f"split-K {'on' if r['split_k'] else 'off'}\ngraph {'on' if r['graph'] else 'off'}" for r in runs]
    vals = [r["decode_tok_s"] for r in runs]
    lc = report.get("launch_cache_switched")
    if lc and lc.get("launch_cache") is False:
        labels.append(f"split-K {'on' if lc['split_k'] else 'off'}\ngraph off,\nno launch cache")
        vals.append(lc["decode_tok_s"])
    modes = [r for r in report.get("decode_mode_runs", []) if "error" not in r]
    for r in modes:
        labels.append(f"{r['decode_mode']}\nsplit-K {'on' if r['split_k'] else 'off'}\n"
                      f"graph {'on' if r['graph'] else 'off'}")
        vals.append(r["decode_tok_s"])
    t = report.get("transformers") or {}
    if "decode_tok_s" in t:
        labels.append("transformers\neager")
        vals.append(t["decode_tok_s"])
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    colors = ["#3b7dd8", "#6aa0e8", "#e8a33b", "#d8703b"][: len(runs)]
    colors += ["#b0643a"] * (len(vals) - len(runs) - len(modes) - (1 if "decode_tok_s" in t else 0))
    colors += ["#2e9d5b"] * len(modes)
    colors += ["#999999"] if "decode_tok_s" in t else []
    bars = ax.bar(labels, vals, color=colors)
    roof = report["roofline"]["tok_s"]
    ax.axhline(roof, color="#c62828", linestyle="--", label=f"HBM roofline {roof:.0f} tok/s")
    ax.axhline(0.8 * roof, color="#c62828", linestyle=":", alpha=0.6, label="80% of roofline")
    for b, v in zip(bars, vals):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"Qwen3.5-0.8B decode on {report['gpu']} (bf16, prompt {report['prompt_len']}, "
                 f"{report['new_tokens']} new tokens)", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
