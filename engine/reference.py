"""The Qwen3.5 text model in plain PyTorch: the oracle every Triton kernel is tested against and
the CPU fallback backend of the app. Written from the math in docs/qwen35-text-model.md.

Rounding follows Hugging Face's implementation: norms and the GDN core in float32, one cast to
the model dtype at the end of each; projections, residual adds and the MLP in the model dtype.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from .options import EngineOptions, SamplingParams
from .backend import Backend
from .config import FULL_ATTENTION, TextConfig
from .sampling import TokenHistory, sample_next


# ---------------------------------------------------------------- operators (shared math) ----

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in float32, one cast."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
    return y.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: w * norm(o) * silu(z); the norm is rounded to the model dtype first."""
    o32 = o.float()
    n = (o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (w.float() * n.float() * F.silu(z.float())).to(o.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) in float32 (eps inside the sqrt, on the sum)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, rotary_dim] of plain (text-only) RoPE, computed in fp32 then cast like HF."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32,
                                             device=positions.device) / rotary_dim))
    ang = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first rotary dims of x [T, H, hd]; the rest passes through."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([xr * c + rot * s, xp], dim=-1)


def causal_conv1d(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over x [T, C] continuing from state [C, K-1] (oldest first).
    Returns (silu(conv) [T, C], new state [C, K-1] = the last K-1 inputs)."""
    K = w.shape[-1]
    seq = torch.cat([state.to(x.dtype), x.t()], dim=1).float()      # [C, K-1+T]
    win = seq.unfold(1, K, 1)                                       # [C, T, K]
    y = (win * w.float()[:, None, :]).sum(-1).t()                   # [T, C]
    new_state = seq[:, -(K - 1):].to(state.dtype)
    return F.silu(y).to(x.dtype), new_state


def gated_delta_rule(q, k, v, g, beta, state):
    """Token-by-token gated delta rule (float32). q,k [T,H,dk] (normalised, q scaled), v [T,H,dv],
    g,beta [T,H], state [H,dk,dv] updated in place. Returns o [T,H,dv] float32."""
    T = q.shape[0]
    out = torch.empty(T, v.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    for t in range(T):
        state.mul_(g[t].exp()[:, None, None])                            # decay
        r = torch.einsum("hkv,hk->hv", state, k[t])                      # prediction S^T k
        delta = beta[t][:, None] * (v[t] - r)                            # delta-rule correction
        state.add_(k[t][:, :, None] * delta[:, None, :])                 # rank-1 write
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])                 # read the updated state
    return out


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


# ------------------------------------------------------------------------------ the model ----

class ReferenceModel:
    """Stateless forward pieces over a weight dict (short names, see engine/weights.py)."""

    def __init__(self, cfg: TextConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights

    # ---- layers ----
    def attention(self, i: int, u: torch.Tensor, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor):
        c, w, p = self.cfg, self.w, f"layers.{i}.self_attn."
        T, H, KV, hd = u.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qg = linear(u, w[p + "q_proj.weight"]).view(T, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
        k = linear(u, w[p + "k_proj.weight"]).view(T, KV, hd)
        v = linear(u, w[p + "v_proj.weight"]).view(T, KV, hd)
        q = rms_norm(q, w[p + "q_norm.weight"], c.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], c.rms_norm_eps)
        pos = torch.arange(start, start + T, device=u.device)
        cos, sin = rope_cos_sin(pos, c.rotary_dim, c.rope_theta, u.dtype)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        k_cache[:, start:start + T] = k.transpose(0, 1)
        v_cache[:, start:start + T] = v.transpose(0, 1)
        L = start + T
        keys = k_cache[:, :L].repeat_interleave(H // KV, dim=0).float()       # [H, L, hd]
        vals = v_cache[:, :L].repeat_interleave(H // KV, dim=0).float()
        scores = torch.einsum("thd,hld->htl", q.float(), keys) * hd ** -0.5
        causal = pos[:, None] >= torch.arange(L, device=u.device)[None, :]    # [T, L]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("htl,hld->thd", probs, vals).to(u.dtype).reshape(T, H * hd)
        o = o * torch.sigmoid(gate)
        return linear(o, w[p + "o_proj.weight"])

    def gated_deltanet(self, i: int, u: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor):
        c, w, p = self.cfg, self.w, f"layers.{i}.linear_attn."
        T = u.shape[0]
        Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        mixed = linear(u, w[p + "in_proj_qkv.weight"])                    # [T, conv_dim] = [q | k | v]
        z = linear(u, w[p + "in_proj_z.weight"]).view(T, Hv, dv)
        b = linear(u, w[p + "in_proj_b.weight"])
        a = linear(u, w[p + "in_proj_a.weight"])
        conv_w = w[p + "conv1d.weight"].view(c.conv_dim, -1)
        mixed, new_conv = causal_conv1d(mixed, conv_w, conv_state)
        conv_state.copy_(new_conv)
        q, k, v = torch.split(mixed, [c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
        q, k, v = q.view(T, Hk, dk), k.view(T, Hk, dk), v.view(T, Hv, dv)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(w[p + "A_log"].float()) * F.softplus(a.float() + w[p + "dt_bias"].float())
        if Hv != Hk:  # value heads grouped over key heads: consecutive repeat
            q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
        q = l2norm(q) * dk ** -0.5
        k = l2norm(k)
        o = gated_delta_rule(q, k, v.float(), g, beta, rec_state).to(u.dtype)
        y = gated_rms_norm(o, z, w[p + "norm.weight"], c.rms_norm_eps).reshape(T, Hv * dv)
        return linear(y, w[p + "out_proj.weight"])

    def mlp(self, i: int, u: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"layers.{i}.mlp."
        return linear(F.silu(linear(u, w[p + "gate_proj.weight"])) * linear(u, w[p + "up_proj.weight"]),
                      w[p + "down_proj.weight"])

    # ---- whole model ----
    def forward(self, ids: torch.Tensor, start: int, state: "ModelState") -> torch.Tensor:
        """Run tokens ids [T] at positions start.. through the model, updating `state`.
        Returns the final-norm hidden state of the last position [D]."""
        h = self.forward_hidden(ids, start, state)
        return rms_norm(h[None], self.w["norm.weight"], self.cfg.rms_norm_eps)[0]

    def forward_hidden(self, ids: torch.Tensor, start: int, state: "ModelState") -> torch.Tensor:
        """Like forward() but returns the last position's residual stream before the final norm."""
        c, w = self.cfg, self.w
        h = w["embed_tokens.weight"][ids]
        for i, kind in enumerate(c.layer_types):
            u = rms_norm(h, w[f"layers.{i}.input_layernorm.weight"], c.rms_norm_eps)
            if kind == FULL_ATTENTION:
                kc, vc = state.kv[i]
                u = self.attention(i, u, start, kc, vc)
            else:
                u = self.gated_deltanet(i, u, state.conv[i], state.rec[i])
            h = h + u
            u = rms_norm(h, w[f"layers.{i}.post_attention_layernorm.weight"], c.rms_norm_eps)
            h = h + self.mlp(i, u)
        return h[-1]

    def lm_head(self, h_last: torch.Tensor) -> torch.Tensor:
        return (h_last @ self.w["lm_head.weight"].t()).float()


class ModelState:
    """KV cache, GDN conv and recurrent states of one conversation (layouts: engine/backend.py)."""

    def __init__(self, cfg: TextConfig, max_context: int, device, dtype):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        gdn = [i for i, kind in enumerate(cfg.layer_types) if kind != FULL_ATTENTION]
        # the recurrent states are views of one buffer, so one address range covers them all
        # (the Triton engine keeps that range in a persisting L2 window: engine/l2_state.py)
        self.rec_buf = torch.zeros(len(gdn), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                   cfg.linear_value_head_dim, device=device, dtype=torch.float32)
        slot = {i: j for j, i in enumerate(gdn)}
        for i, kind in enumerate(cfg.layer_types):
            if kind == FULL_ATTENTION:
                shape = (cfg.num_key_value_heads, max_context, cfg.head_dim)
                self.kv[i] = (torch.zeros(shape, device=device, dtype=dtype),
                              torch.zeros(shape, device=device, dtype=dtype))
            else:
                self.conv[i] = torch.zeros(cfg.conv_dim, cfg.linear_conv_kernel_dim - 1, device=device, dtype=dtype)
                self.rec[i] = self.rec_buf[slot[i]]
        self.length = 0

    def zero_(self) -> None:
        for t in list(self.conv.values()) + list(self.rec.values()):
            t.zero_()
        self.length = 0  # KV entries past length are never read

    def snapshot(self):
        return (self.length, {i: t.clone() for i, t in self.conv.items()},
                {i: t.clone() for i, t in self.rec.items()})

    def restore(self, snap) -> None:
        length, conv, rec = snap
        for i, t in conv.items():
            self.conv[i].copy_(t)
        for i, t in rec.items():
            self.rec[i].copy_(t)
        self.length = length


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


class ReferenceBackend(Backend):
    """The plain-PyTorch backend: CPU or CUDA, float32/bfloat16/float16."""

    name = "reference"

    def __init__(self, cfg: TextConfig, weights: dict[str, torch.Tensor], options: EngineOptions,
                 valid_vocab: Optional[int] = None):
        self.cfg = cfg
        self.options = options
        self.device = torch.device(options.device)
        self.dtype = torch_dtype(options.dtype)
        self.model = ReferenceModel(cfg, weights)
        self.state = ModelState(cfg, options.max_context, self.device, self.dtype)
        self.valid_vocab = min(valid_vocab or cfg.vocab_size, cfg.vocab_size)
        self._logits: Optional[torch.Tensor] = None
        self._history: Optional[TokenHistory] = None
        self._params = SamplingParams()
        self._gen: Optional[torch.Generator] = None

    @property
    def length(self) -> int:
        return self.state.length

    def reset(self) -> None:
        self.state.zero_()
        self._logits = None

    @torch.inference_mode()
    def prefill(self, ids: Sequence[int]) -> None:
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)
        self._check_room(len(ids_t))
        h = self.model.forward(ids_t, self.state.length, self.state)
        self.state.length += len(ids_t)
        self._logits = self.model.lm_head(h)

    def decode(self, token_id: int) -> None:
        self.prefill([token_id])

    def _check_room(self, n: int) -> None:
        from .errors import ContextFullError
        if self.state.length + n > self.options.max_context:
            raise ContextFullError(
                f"The conversation needs {self.state.length + n} tokens but the context holds "
                f"{self.options.max_context}; start a new chat or raise the context length.")

    def logits(self) -> torch.Tensor:
        assert self._logits is not None, "prefill() first"
        return self._logits

    def begin_sampling(self, params: SamplingParams, history_ids: Sequence[int]) -> None:
        self._params = params
        self._history = TokenHistory(self.cfg.vocab_size, history_ids, self.device)
        self._gen = None
        if params.seed is not None:
            self._gen = torch.Generator(device=self.device).manual_seed(int(params.seed))

    def sample(self) -> int:
        if self._history is None:
            self.begin_sampling(self._params, [])
        tok = sample_next(self.logits(), self._params, self._history, self.valid_vocab, self._gen)
        self._history.add(tok)
        return tok

    def snapshot(self):
        return self.state.snapshot()

    def restore(self, snap) -> None:
        self.state.restore(snap)
        self._logits = None

    def set_max_context(self, n: int) -> None:
        """Re-allocate the KV cache for a new context length (the conversation is forgotten)."""
        self.state = None
        self.options.max_context = int(n)
        self.state = ModelState(self.cfg, self.options.max_context, self.device, self.dtype)
        self._logits = None
