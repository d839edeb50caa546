"""`tritonchat` command line: generate, chat, bench, verify and make-tiny (app/launcher.py adds
the app and install-desktop, so the engine never imports the app).

Bad input gets one sentence on stderr and exit code 2 (--debug shows the traceback).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from typing import Optional

from .errors import TritonChatError

EXIT_BAD_INPUT = 2


class UsageError(TritonChatError):
    pass


def _add_engine_args(p: argparse.ArgumentParser, bench: bool = False) -> None:
    """The engine's options as flags, one per field of EngineOptions (engine/options.py)."""
    from .options import EngineOptions, choice_fields, fields_by_name, switch_fields
    f = fields_by_name()
    p.add_argument("--backend", choices=f["backend"].metadata["choices"], default="triton" if bench else None,
                   help=f["backend"].metadata["help"] + ("" if bench else " (default: triton on CUDA, else reference)"))
    p.add_argument("--device", default=None, help=f["device"].metadata["help"] + " (default: cuda if available)")
    p.add_argument("--dtype", choices=f["dtype"].metadata["choices"], default="bfloat16" if bench else None,
                   help=f["dtype"].metadata["help"] + ("" if bench else " (default: bfloat16 on CUDA, float32 on CPU)"))
    p.add_argument("--context", type=int, default=None,
                   help=f"{f['max_context'].metadata['help']} (default {EngineOptions.max_context})")
    for c in choice_fields():
        p.add_argument("--" + c.name.replace("_", "-"), choices=c.metadata["choices"], default=None,
                       help=f"{c.metadata['help']} (default {c.default})")
    for sw in switch_fields():
        measured = sw.metadata["measured"]
        p.add_argument("--" + sw.name.replace("_", "-"), choices=["on", "off"], default=None,
                       help=f"{sw.metadata['help']} (default {'on' if sw.default else 'off'}"
                            f"{'; ' + measured if measured else ''})")


def engine_options(args, context_default: int = 32768):
    """EngineOptions from the flags of _add_engine_args, validated."""
    from .options import choice_fields, default_options, switch_fields
    switches = {sw.name: getattr(args, sw.name) == "on" for sw in switch_fields()
                if getattr(args, sw.name) is not None}
    switches.update({c.name: getattr(args, c.name) for c in choice_fields()
                     if getattr(args, c.name) is not None})
    ctx = args.context if args.context is not None else context_default
    return default_options(device=args.device, backend=args.backend, dtype=args.dtype, max_context=ctx,
                           **switches)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder or hub id (default Qwen/Qwen3.5-0.8B)")
    _add_engine_args(p)
    p.add_argument("--offline", action="store_true", help="never download; use the cache or --model DIR")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--greedy", action="store_true", help="argmax decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-turn tokens")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tritonchat", description="Chat with Qwen3.5-0.8B on hand-written Triton kernels; with no sub-command the desktop app opens.")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    ap.add_argument("--model", dest="app_model", default=None, help="(app) model folder or hub id")
    ap.add_argument("--demo", action="store_true",
                    help="(app) open the app on a tiny random-weight model: no GPU, no download")
    sub = ap.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    _add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (raw, or the user message with --chat)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, fed verbatim")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--system", default=None, help="system prompt (with --chat)")
    g.add_argument("--thinking", action="store_true", help="enable thinking (with --chat)")
    _add_sampling_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    g.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    c = sub.add_parser("chat", help="chat in the terminal")
    _add_model_args(c)
    c.add_argument("--system", default=None)
    c.add_argument("--thinking", action="store_true")
    _add_sampling_args(c)
    c.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    b = sub.add_parser("bench", help="measure decode speed against the HBM roofline")
    b.add_argument("--model", default=None, help="model folder (default: --random-weights)")
    b.add_argument("--random-weights", action="store_true", help="true 0.8B shape, random values")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=512)
    _add_engine_args(b, bench=True)
    b.add_argument("--compare", action="store_true",
                   help="split-K x graph matrix, the other decode mode, transformers eager, long-context decode")
    b.add_argument("--prefill-lens", default=None, help="comma-separated prompt lengths for the TTFT table")
    b.add_argument("--plot", default=None, help="write a PNG of the --compare results here")
    b.add_argument("--json", action="store_true")
    b.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    v = sub.add_parser("verify", help="hash every model file against its download record; check every tensor")
    v.add_argument("--model", default=None, help="model folder or hub id (default Qwen/Qwen3.5-0.8B)")
    v.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    t = sub.add_parser("make-tiny", help="write a tiny random-weight Qwen3.5 model (try the app with no "
                                         "GPU and no download: tritonchat --model DIR)")
    t.add_argument("dir", help="a new or empty folder")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    d = sub.add_parser("install-desktop", help="install the .desktop file and icons for this user")
    d.add_argument("--uninstall", action="store_true")
    d.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return ap


# ---------------------------------------------------------------------------- helpers ----

def check_model_folder(model: Optional[str]) -> None:
    """A --model written as a path must be a model folder: said at once, before torch or Qt load."""
    from . import hub
    if not model or not hub.is_local_dir(model):
        return
    path = os.path.expanduser(model)
    if not os.path.isdir(path):
        raise UsageError(f"The model folder {model} does not exist.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{model} is not a model folder (it has no config.json).")


def _model_dir(model: Optional[str], offline: bool):
    from . import hub
    return hub.resolve_model(model or hub.DEFAULT_MODEL, offline=offline, progress=hub.cli_progress_printer())


def _sampling(args, defaults):
    """The model's recommended sampling with the flags given on top, validated."""
    from dataclasses import replace
    from .options import check_max_new_tokens
    p = replace(defaults)
    for name in ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "repetition_penalty", "seed"):
        v = getattr(args, name)
        if v is not None:
            setattr(p, name, v)
    if args.greedy:
        p.greedy = True
    check_max_new_tokens(args.max_new_tokens)
    return p.validate()


def _parse_ids(text: str, vocab: int) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError("--prompt-ids must be comma-separated integers, e.g. 1,2,3.") from None
    if not ids:
        raise UsageError("--prompt-ids is empty.")
    bad = [i for i in ids if i < 0 or i >= vocab]
    if bad:
        raise UsageError(f"--prompt-ids holds {bad[0]}, outside the vocabulary (0..{vocab - 1}).")
    return ids


# --------------------------------------------------------------------------- commands ----

def cmd_generate(args) -> int:
    from .generation import Generator
    from .session import ChatSession

    model_dir = _model_dir(args.model, args.offline)
    session = ChatSession.load(model_dir, engine_options(args))
    tok = session.tokenizer
    params = _sampling(args, session.generation_defaults)
    if args.prompt_ids is not None:
        prompt = _parse_ids(args.prompt_ids, session.backend.cfg.vocab_size)
    elif args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        prompt = tok.encode_chat(messages, add_generation_prompt=True, enable_thinking=args.thinking)
    else:
        prompt = tok.encode(args.prompt)
        if not prompt:
            raise UsageError("--prompt is empty.")
    decoder = tok.stream_decoder()
    stream = not args.json

    def on_token(t: int) -> None:
        if stream:
            sys.stdout.write(decoder.push(t))
            sys.stdout.flush()

    gen = Generator(session.backend, tok.stop_ids)
    result = gen.generate(prompt, params, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                          on_token=on_token)
    result.text = tok.decode(result.token_ids)
    if stream:
        sys.stdout.write(decoder.flush() + "\n")
    s = result.stats
    print(f"[{s.prompt_tokens} prompt tokens, {s.new_tokens} new; TTFT {s.ttft_ms:.1f} ms, "
          f"prefill {s.prefill_tok_s:.1f} tok/s, decode {s.decode_tok_s:.1f} tok/s; stop: {s.stop_reason}; "
          f"{session.backend.name} {session.options.device} {session.options.dtype}]", file=sys.stderr)
    if args.json:
        d = result.to_dict()
        d.update(backend=session.backend.name, device=session.options.device, dtype=session.options.dtype)
        print(json.dumps(d, ensure_ascii=False))
    return 0


def cmd_chat(args) -> int:
    from .session import ChatSession

    model_dir = _model_dir(args.model, args.offline)
    print(f"Loading {model_dir} ...", file=sys.stderr)
    session = ChatSession.load(model_dir, engine_options(args))
    params = _sampling(args, session.generation_defaults)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message; /reset starts over, /quit or Ctrl-D leaves, Ctrl-C stops an answer.", file=sys.stderr)
    _tolerant_stdin()
    while True:
        try:
            line = input("\n> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        except UnicodeDecodeError:  # a strict terminal encoding and bytes that are not UTF-8
            print("That line is not valid UTF-8 text, so it was not sent; type it again.", file=sys.stderr)
            continue
        if not line.strip():
            continue
        line = _repaired_line(line)
        if line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            session.reset()
            continue
        messages.append({"role": "user", "content": line})
        stop = threading.Event()
        state = {"thinking": False}

        def on_text(th: str, an: str) -> None:
            if th:
                if not state["thinking"]:
                    sys.stdout.write("\x1b[2m[thinking] ")
                    state["thinking"] = True
                sys.stdout.write(th)
            if an:
                if state["thinking"]:
                    sys.stdout.write("\x1b[0m\n")
                    state["thinking"] = False
                sys.stdout.write(an)
            sys.stdout.flush()

        try:
            reply = session.generate(messages, params, max_new_tokens=args.max_new_tokens,
                                     enable_thinking=args.thinking, stop_event=stop, on_text=on_text,
                                     ignore_eos=args.ignore_eos)
        except KeyboardInterrupt:
            stop.set()
            print("\n[stopped]")
            messages.pop()
            session.reset()
            continue
        except TritonChatError as e:
            print(f"\n{e}", file=sys.stderr)
            messages.pop()
            continue
        if state["thinking"]:
            sys.stdout.write("\x1b[0m")
        s = reply.result.stats
        print(f"\n\x1b[2m[{s.new_tokens} tokens, TTFT {s.ttft_ms:.0f} ms, {s.decode_tok_s:.1f} tok/s, "
              f"{s.stop_reason}]\x1b[0m", file=sys.stderr)
        msg = {"role": "assistant", "content": reply.answer}
        if reply.thinking:
            msg["reasoning_content"] = reply.thinking
        messages.append(msg)


def _tolerant_stdin() -> None:
    """Bytes that are not UTF-8 arrive as lone surrogates instead of ending input() with an error
    (a strict terminal encoding would also throw away the rest of a piped input)."""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(errors="surrogateescape")
        except (ValueError, OSError):
            pass


def _repaired_line(line: str) -> str:
    from .tokenizer import repair_text
    fixed = repair_text(line)
    if fixed != line:
        print("Some characters of that line were not valid UTF-8; they are sent as \ufffd.", file=sys.stderr)
    return fixed


def cmd_bench(args) -> int:
    from .bench import run_bench
    return run_bench(args, engine_options(args))


def cmd_verify(args) -> int:
    """Per file: ok / damaged / unchecked; every tensor checked for NaN/inf. Exit 1 when damaged."""
    from pathlib import Path
    from . import hub
    model = args.model or hub.DEFAULT_MODEL
    if hub.is_local_dir(model):
        folder = Path(model).expanduser()
        if not folder.is_dir():
            raise UsageError(f"The model folder {folder} does not exist.")
    else:
        found = hub.local_model_dir(model) or (hub._damaged_snapshot(model, hub.DEFAULT_REVISION) or (None,))[0]
        if found is None:
            raise UsageError(f"{model} is not downloaded; run tritonchat once to download it, or pass --model DIR.")
        folder = found
    print(f"Checking {folder}")
    damaged = 0
    for c in hub.check_snapshot(folder, full=True):
        label = {"ok": "ok", "damaged": "DAMAGED", "unverified": "unchecked"}[c.status]
        damaged += c.status == "damaged"
        print(f"  {label:<9} {c.name}" + (f" ({c.detail})" if c.status != "ok" else ""))
    damaged += _verify_tensors(folder)
    if damaged:
        print(f"{damaged} damaged; download the model again (tritonchat replaces damaged files), "
              "or replace them by hand.", file=sys.stderr)
        return 1
    print("All files are intact.")
    return 0


def _verify_tensors(folder) -> int:
    from .errors import ModelFilesError
    from .weights import _open, first_non_finite, weight_files
    bad = 0
    try:
        files = weight_files(folder)
    except ModelFilesError as e:
        print(f"  DAMAGED   weights ({e})")
        return 1
    for path in files:
        try:
            f = _open(path, "cpu")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # a truncated file: safetensors' own errors
            print(f"  DAMAGED   {path.name}: tensors cannot be read ({str(e).splitlines()[0][:100]})")
            bad += 1
            continue
        floats = {k: t for k, t in tensors.items() if t.is_floating_point()}
        key = first_non_finite(floats)
        if key is None:
            print(f"  ok        {path.name}: {len(floats)} tensors, all finite")
        else:
            print(f"  DAMAGED   {path.name}: the tensor '{key}' holds NaN or infinite values")
            bad += 1
    return bad


def cmd_make_tiny(args) -> int:
    from .tiny_model import make_tiny_model
    folder = make_tiny_model(args.dir, seed=args.seed)
    print(f"Wrote a tiny random-weight Qwen3.5 model to {folder} (its answers are gibberish); "
          f"open it with: tritonchat --model {folder}")
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench, "verify": cmd_verify,
            "make-tiny": cmd_make_tiny}


def _no_app(args) -> int:
    raise UsageError("The desktop app and install-desktop start from the `tritonchat` program "
                     "(python -m tritonchat.app.launcher); this module runs the engine's commands.")


def main(argv: Optional[list[str]] = None, app_commands: Optional[dict] = None) -> int:
    """Run one command; app_commands (app/launcher.py) adds the app and install-desktop."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False)) or os.environ.get("TRITONCHAT_DEBUG") == "1"
    try:
        check_model_folder(getattr(args, "model", None) or getattr(args, "app_model", None))
        commands = {**COMMANDS, **(app_commands or {})}
        return commands.get(args.command, _no_app)(args)
    except TritonChatError as e:
        if debug:
            traceback.print_exc()
        print(f"tritonchat: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("tritonchat: interrupted.", file=sys.stderr)
        return 130
    except Exception as e:  # an unexpected failure: one line, the traceback only with --debug
        if debug:
            traceback.print_exc()
        first = (str(e).splitlines() or [""])[0][:200]
        hint = _hint(e)
        print(f"tritonchat: {hint or f'internal error ({type(e).__name__}: {first})'}; rerun with --debug for details.",
              file=sys.stderr)
        return 1


def _hint(e: Exception) -> str:
    msg = str(e)
    if "out of memory" in msg.lower():
        return "the GPU ran out of memory (try a shorter --context)"
    if "Failed to find C compiler" in msg or "Python.h" in msg:
        return "Triton cannot compile its kernels: install a C compiler and the Python headers (e.g. gcc, python3-dev)"
    return ""


if __name__ == "__main__":
    sys.exit(main())
