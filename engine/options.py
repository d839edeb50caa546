"""The engine's options and the sampler's parameters: one dataclass each, validated here.

Every switch that changes what the engine launches is a field of `EngineOptions`, with its
one-line help, its label in the settings dialog and its key in the stats line in the field's
metadata. The CLI flags (engine/cli.py), the settings dialog (app/settings_dialog.py), the bench
(engine/bench.py) and the stats line (`stats_fields`) are generated from these fields, so adding
a switch here is the whole of its plumbing outside the code that obeys it. A setting of named
values (`decode_mode`) is a `_choice` field with the same metadata and its `choices`: the CLI
flag, the settings dialog's drop-down and the stats line come from it (`choice_fields`) as they
come from the switches; the bench compares its values beside the switches' configurations.

No torch and no Qt here: the app imports this module before it has a GPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Iterator, Optional

from .errors import TritonChatError


class OptionError(TritonChatError):
    """An option or a sampling value out of range; the message is one sentence for the user."""


# Where a switch has an effect. The settings dialog greys a switch out (with this reason) and the
# stats line leaves it out when the running engine is outside its scope.
SCOPE_ALL = "all"
SCOPE_TRITON = "triton"          # the Triton backend (GPU, or the interpreter on the CPU)
SCOPE_CUDA = "cuda"              # the Triton backend on a CUDA GPU
SCOPE_GRAPH = "graph"            # the Triton backend on a CUDA GPU with the CUDA graph on
SCOPE_NO_GRAPH = "no_graph"      # the Triton backend on a CUDA GPU with the CUDA graph off

SCOPE_REASON = {
    SCOPE_TRITON: "only the Triton engine has this switch (the CPU reference engine runs plain PyTorch)",
    SCOPE_CUDA: "needs the Triton engine on a CUDA GPU",
    SCOPE_GRAPH: "needs the Triton engine on a CUDA GPU with the CUDA graph on",
    SCOPE_NO_GRAPH: "applies only with the CUDA graph off",
}


DEFAULT_CONTEXT = 32768       # tokens; a model with fewer positions gets its own limit


def _choice(default: str, choices: tuple, help: str, label: str, stats: str, scope: str) -> Any:
    """An engine setting of a few named values (a CLI flag with choices); like a switch it
    changes what the engine launches, not the model."""
    return field(default=default, metadata=dict(help=help, choices=choices, label=label, stats=stats,
                                                scope=scope, choice=True))


def _switch(default: bool, help: str, label: str, stats: str, scope: str, measured: str = "") -> Any:
    """A boolean engine switch, changeable while a model is loaded (no reload)."""
    return field(default=default, metadata=dict(help=help, label=label, stats=stats, scope=scope,
                                                measured=measured, switch=True))


@dataclass
class EngineOptions:
    """How the engine is built and which decode-step variant it runs."""

    backend: str = field(default="reference", metadata=dict(
        help="inference engine: triton (our kernels) or reference (plain PyTorch)",
        choices=("reference", "triton")))
    device: str = field(default="cpu", metadata=dict(help="cpu or cuda (cuda:N for another GPU)"))
    dtype: str = field(default="float32", metadata=dict(
        help="weights and activations: bfloat16, float16 or float32",
        choices=("bfloat16", "float16", "float32")))
    max_context: int = field(default=DEFAULT_CONTEXT, metadata=dict(
        help="context length in tokens (prompt + answer)"))

    decode_mode: str = _choice(
        "per_op", ("per_op", "persistent"),
        "the decode step as one kernel launch per operator (per_op) or as ONE persistent kernel whose "
        "programs stream the next operators' weights while they wait (persistent; on the CPU its "
        "one-launch-per-operator form)",
        "Decode step", "decode", SCOPE_TRITON)
    split_k: bool = _switch(
        True, "split the long K dimension of narrow GEMVs over several programs, so every SM streams "
              "weights (when the tuned plan splits no shape on this GPU, on and off run the same step)",
        "Split-K GEMV", "split-K", SCOPE_TRITON)
    graph: bool = _switch(
        True, "replay each decode step as one CUDA graph instead of launching its kernels one by one",
        "CUDA graph for decode", "graph", SCOPE_CUDA, "H200: 1,712 tok/s on, 1,250 off (launch cache on)")
    pdl: bool = _switch(
        True, "programmatic dependent launch: a kernel starts loading weights while the previous one "
              "drains (Hopper and newer)",
        "Overlap kernels (PDL)", "PDL", SCOPE_CUDA, "H200: +8% decode tok/s")
    pdl_early: bool = _switch(
        False, "with PDL, release the next kernel at the start of each kernel instead of after its "
               "dependency wait",
        "Early PDL trigger", "PDL early", SCOPE_CUDA, "H200: slower than the default (the tuner's verdict)")
    l2_state: bool = _switch(
        True, "keep the Gated DeltaNet recurrent states in a persisting L2 window between steps",
        "GDN states in L2", "L2 states", SCOPE_GRAPH, "H200: 1,712 tok/s on, 1,697 off")
    context_ranges: bool = _switch(
        True, "use the kernel plans tuned per range of positions (one graph per range) instead of one "
              "plan for every length",
        "Kernel plans per context range", "context ranges", SCOPE_TRITON,
        "H200: 1,712 tok/s on, 1,695 off; at 32K 1,385 vs 1,364")
    launch_cache: bool = _switch(
        True, "with the graph off, replay the step's recorded kernel launches instead of going "
              "through Triton's Python dispatch for each",
        "Launch cache (graph off)", "launch cache", SCOPE_NO_GRAPH, "H200, graph off: 1,250 tok/s on, 145 off")
    prefill_graph: bool = _switch(
        True, "capture each prompt length's prefill as a CUDA graph (replayed for the same length)",
        "CUDA graph for prefill", "prefill graph", SCOPE_CUDA, "H200: TTFT at 128 tokens 2.9 ms on, 14.5 ms off")
    timing: bool = _switch(
        False, "time every kernel of the decode step on the GPU (the timing panel); costs a little speed",
        "Per-kernel timing", "timing", SCOPE_TRITON)

    # ------------------------------------------------------------------ checks ----

    def validate(self) -> "EngineOptions":
        """Raise OptionError (one sentence) for a value no engine accepts; return self."""
        if self.backend not in ("reference", "triton"):
            raise OptionError(f"Unknown backend '{self.backend}'; use reference or triton.")
        if self.device not in ("cpu", "cuda") and not _is_cuda_index(self.device):
            raise OptionError(f"Unknown device '{self.device}'; use cpu or cuda.")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise OptionError(f"Unknown dtype '{self.dtype}'; use bfloat16, float16 or float32.")
        if isinstance(self.max_context, bool) or not isinstance(self.max_context, int) or self.max_context < 2:
            raise OptionError("The context length must be a whole number of at least 2 tokens.")
        for f in switch_fields():
            if not isinstance(getattr(self, f.name), bool):
                raise OptionError(f"The option {f.name} must be on or off.")
        for f in choice_fields():
            if getattr(self, f.name) not in f.metadata["choices"]:
                raise OptionError(f"Unknown {f.name.replace('_', ' ')} '{getattr(self, f.name)}'; use "
                                  f"{' or '.join(f.metadata['choices'])}.")
        return self

    def check_context(self, model_max: int) -> None:
        """The context must fit the model's position range (its max_position_embeddings); the
        default context shrinks to a smaller model's range, a context asked for does not."""
        if self.max_context > model_max and self.max_context == DEFAULT_CONTEXT:
            self.max_context = model_max
        elif self.max_context > model_max:
            raise OptionError(f"The context length {self.max_context:,} is beyond this model's "
                              f"{model_max:,} positions; choose at most {model_max:,}.")

    # ------------------------------------------------------------------ scope ----

    def applies(self, name: str) -> bool:
        """Does switch `name` change anything for an engine built with these options?"""
        scope = fields_by_name()[name].metadata["scope"]
        triton = self.backend == "triton"
        cuda = triton and self.device.startswith("cuda")
        return {SCOPE_ALL: True, SCOPE_TRITON: triton, SCOPE_CUDA: cuda,
                SCOPE_GRAPH: cuda and self.graph, SCOPE_NO_GRAPH: cuda and not self.graph}[scope]

    def effective(self) -> "EngineOptions":
        """The options as the engine runs them: a switch outside its scope reads off."""
        return replace(self, **{f.name: getattr(self, f.name) and self.applies(f.name)
                                for f in switch_fields()})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _is_cuda_index(device: str) -> bool:
    return device.startswith("cuda:") and device[5:].isdigit()


def switch_fields() -> list:
    """The boolean switches, in the order the settings dialog and the CLI list them."""
    return [f for f in fields(EngineOptions) if f.metadata.get("switch")]


def choice_fields() -> list:
    """The engine settings of named values (decode_mode), in declaration order."""
    return [f for f in fields(EngineOptions) if f.metadata.get("choice")]


def check_switches(switches: dict) -> dict:
    """{name: bool} for configure(); an unknown name or a non-bool value is an OptionError."""
    names = {f.name for f in switch_fields()}
    for name, on in switches.items():
        if name not in names:
            raise OptionError(f"There is no engine switch named {name}.")
    return {name: bool(on) for name, on in switches.items() if on is not None}


def fields_by_name() -> dict:
    return {f.name: f for f in fields(EngineOptions)}


def stats_fields(options: EngineOptions) -> Iterator[tuple[str, str]]:
    """(stats label, value) for each switch ("on" / "off") and each named-value setting (its
    value, e.g. "persistent") that applies to this engine, in declaration order, timing excluded."""
    for f in fields(EngineOptions):
        if f.name == "timing" or not (f.metadata.get("switch") or f.metadata.get("choice")):
            continue
        if options.applies(f.name):
            value = getattr(options, f.name)
            yield f.metadata["stats"], (("on" if value else "off") if f.metadata.get("switch") else str(value))


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def default_options(device: Optional[str] = None, backend: Optional[str] = None,
                    dtype: Optional[str] = None, **kw) -> EngineOptions:
    """Defaults: CUDA if available else CPU; Triton on CUDA else reference; bf16 on CUDA else fp32."""
    device = device or ("cuda" if cuda_available() else "cpu")
    backend = backend or ("triton" if device.startswith("cuda") else "reference")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return EngineOptions(backend=backend, device=device, dtype=dtype, **kw).validate()


# ------------------------------------------------------------------------ sampling ----

@dataclass
class SamplingParams:
    """How the next token is chosen. greedy=True (or temperature == 0) means argmax."""

    temperature: float = 1.0
    top_k: int = 20            # 0 = off
    top_p: float = 1.0         # 1.0 = off
    min_p: float = 0.0         # 0.0 = off
    presence_penalty: float = 0.0      # subtracted once from logits of every token already generated
    repetition_penalty: float = 1.0    # HF style: logit/r if > 0 else logit*r, over prompt + generated
    seed: Optional[int] = None
    greedy: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature <= 0.0

    def validate(self) -> "SamplingParams":
        """Raise OptionError (one sentence, naming the CLI flag) for a value out of range."""
        def number(name: str, v, integer: bool = False) -> float:
            kinds = (int,) if integer else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise OptionError(f"{_flag(name)} must be a {'whole ' if integer else ''}number, not {v!r}.")
            if not math.isfinite(v):
                raise OptionError(f"{_flag(name)} must be a finite number, not {v}.")
            return v

        if number("temperature", self.temperature) < 0:
            raise OptionError("--temperature must be >= 0 (0 = greedy).")
        if number("top_k", self.top_k, integer=True) < 0:
            raise OptionError("--top-k must be >= 0 (0 = off).")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            raise OptionError("--top-p must be in (0, 1] (1 = off).")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            raise OptionError("--min-p must be in [0, 1] (0 = off).")
        number("presence_penalty", self.presence_penalty)
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise OptionError("--repetition-penalty must be > 0 (1 = off).")
        if self.seed is not None:
            number("seed", self.seed, integer=True)
        if not isinstance(self.greedy, bool):
            raise OptionError("greedy must be true or false.")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def check_max_new_tokens(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise OptionError(f"--max-new-tokens must be a whole number of at least 1, not {n!r}.")
    return n


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
