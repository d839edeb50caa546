"""Stop 33: the eager (graph off) decode with the launch cache on and off, and the graph, in one
process at the true shape (random weights): tok/s through the bench's decode_run (prompt 128,
256 new tokens, greedy), tokens compared.
    bash experiments/stop33/run.sh experiments/stop33/eager_ab.py
"""
from tritonchat.engine.api import EngineOptions
from tritonchat.engine.bench import _random_prompt, decode_run
from tritonchat.engine.config import qwen35_08b_config
from tritonchat.engine.loader import random_backend


def main():
    cfg = qwen35_08b_config()
    be = random_backend(cfg, EngineOptions(backend="triton", device="cuda", dtype="bfloat16",
                                           max_context=4096, split_k=True, graph=True))
    prompt = _random_prompt(128, cfg.vocab_size)
    ref = None
    for rnd in range(2):
        for graph, cache in ((True, True), (False, True), (False, False)):
            be.configure(graph=graph, launch_cache=cache)
            r = decode_run(be, prompt, 256)
            toks = r.pop("token_ids")
            ref = ref or toks
            print(f"round {rnd} graph {graph} cache {cache}: {r['decode_tok_s']:.1f} tok/s "
                  f"{r['ms_per_token']:.3f} ms/token replay={be.launch_replay_active} "
                  f"equal={toks == ref} err={be.launch_cache_error} "
                  f"recorded={[(len(r), r.direct) for r in be._replays.values()]}", flush=True)


if __name__ == "__main__":
    main()
