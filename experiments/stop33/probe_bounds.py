"""Stop 33: two ceilings at the step's boundaries, measured in the captured step on the device.

  * `two_steps`: two decode steps captured into one CUDA graph (the position and token advance on
    the device, as in the one-step graph), ms per step against the one-step graph replayed
    twice as often. What a multi-step graph could save at the graph boundary.
  * `no_embed`: the step without its embedding kernel (the layers read whatever h holds). The
    ceiling of folding the embedding gather into layer 0's in_proj prologue.

Best of 5 alternating rounds at each position; prints ms and ratios. Run on the device:
    bash experiments/stop33/run.sh experiments/stop33/probe_bounds.py
"""
import sys


from tritonchat.engine.api import EngineOptions
from tritonchat.engine.config import qwen35_08b_config
from tritonchat.engine.loader import random_backend
from tritonchat.kernels.tune_decode import replay_ms

POSITIONS = [int(p) for p in sys.argv[1:]] or [640, 8192, 32704]


def main():
    be = random_backend(qwen35_08b_config(), EngineOptions(
        backend="triton", device="cuda", dtype="bfloat16", max_context=33280, split_k=True, graph=True))
    plain = be._decode_step

    def two():
        plain()
        plain()

    def no_embed():
        be._layers_step()
        be._head_step(be._sampling_key == "sample", advance=True)

    variants = {"plain": (plain, 1), "two_steps": (two, 2), "no_embed": (no_embed, 1)}
    graphs = {}
    for name, (fn, k) in variants.items():
        be._decode_step = fn
        be._invalidate_graph()
        graphs[name] = {p: be.graph_for(p) for p in POSITIONS}
        print(f"captured {name}", flush=True)
    be._decode_step = plain
    best = {n: {p: float("inf") for p in POSITIONS} for n in variants}
    for r in range(5):
        for name, (fn, k) in variants.items():
            for p in POSITIONS:
                g = graphs[name][p]
                ms = min(replay_ms(g, 40 // k, before=lambda: be.pos_buf.fill_(p)) / k for _ in range(3))
                best[name][p] = min(best[name][p], ms)
    for p in POSITIONS:
        b = best["plain"][p]
        print(f"pos {p}: plain {b:.4f} ms; two_steps {best['two_steps'][p]:.4f} "
              f"({best['two_steps'][p] / b:.4f}); no_embed {best['no_embed'][p]:.4f} "
              f"({best['no_embed'][p] / b:.4f})", flush=True)


if __name__ == "__main__":
    main()
