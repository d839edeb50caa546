"""Stop 33: where the host time of an eager (graph off) decode step goes, on the device.

Times 200 eager steps at the true shape (random weights), then profiles 100 more with cProfile
and prints the top functions by own time and by cumulative time.
    bash experiments/stop33/run.sh experiments/stop33/profile_eager.py
"""
import cProfile
import pstats
import time

import torch

from tritonchat.engine.api import EngineOptions
from tritonchat.engine.config import qwen35_08b_config
from tritonchat.engine.loader import random_backend
from tritonchat.engine.api import SamplingParams


def main():
    be = random_backend(qwen35_08b_config(), EngineOptions(
        backend="triton", device="cuda", dtype="bfloat16", max_context=4096, split_k=True, graph=False))
    prompt = list(range(1, 129))
    be.prefill(prompt)
    be.begin_sampling(SamplingParams(greedy=True), prompt)
    tok = be.sample()
    for split_k in (True, False):
        be.configure(split_k=split_k)
        for _ in range(20):
            tok = be.step(tok)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            be.launch_step(tok)
            tok = be.finish_step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / 200
        print(f"split_k={split_k}: eager step {dt * 1e3:.3f} ms ({1 / dt:.1f} tok/s) at {be.length}", flush=True)
    # the step alone, no token read back each time (host launch rate)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for _ in range(200):
            be._decode_step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 200
    print(f"_decode_step alone: {dt * 1e3:.3f} ms", flush=True)
    pr = cProfile.Profile()
    with torch.inference_mode():
        pr.enable()
        for _ in range(100):
            be._decode_step()
        torch.cuda.synchronize()
        pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
