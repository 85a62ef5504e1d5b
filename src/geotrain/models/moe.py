"""A mixture-of-experts MLP (Mixtral, Qwen3-MoE; Qwen2-MoE's gated shared expert): top-k routing,
the experts' weights stacked (experts, rows, cols) so expert parallelism shards their first dim,
and the load-balancing loss.

Routing is transformers': softmax of the router's logits in fp32, the top k, renormalised where
the family does (`norm_topk`). The routed rows are sorted by expert and each expert's gated MLP
runs on its own rows (`expert_mlp`); `MoE.dispatch`, set from outside (`runtime.expert_parallel`),
sends them to the rank holding their expert instead -- the model knows nothing of processes.

The load-balancing loss is Switch Transformer's per layer, E * sum_e f_e * P_e (f_e: the share of
top-k picks that went to expert e, P_e: its mean router probability), over the tokens of one
forward, weighted by `router_aux_coef`. It reaches the gradients without travelling with the
activations: `AuxLoss` adds its gradient in backward, scaled like the language-model loss of the
micro-batch (`aux_loss_scale`: the interpreter's 1 / micro-batches x the fp16 loss scale). For
one layer it is transformers' `load_balancing_loss_func`; for several, transformers pools the
counts of every layer first, which a pipeline stage cannot (Megatron and torchtitan also sum per layer).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_AUX_SCALE = contextvars.ContextVar("geotrain_moe_aux_scale", default=1.0)


@contextlib.contextmanager
def aux_loss_scale(scale: float):
    """Within: the load-balancing loss's gradient is scaled like a loss multiplied by `scale`."""
    token = _AUX_SCALE.set(scale)
    try:
        yield
    finally:
        _AUX_SCALE.reset(token)


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, the gradient of `scale * aux` for `aux`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


def expert_mlp(xs: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor, act: Callable) -> torch.Tensor:
    """Rows grouped by expert (counts[e] rows for expert e of the stacked weights) -> each
    through its expert's gated MLP. An expert without rows still joins the graph (zero gradient)."""
    outs = []
    # unbind: one gradient tensor per stacked weight in backward (indexing w[e] would zero-fill a
    # whole-size gradient per expert: 61 % of a CPU step at 8 experts)
    for part, g, u, d in zip(torch.split(xs, counts), w_gate.unbind(0), w_up.unbind(0), w_down.unbind(0),
                             strict=True):
        h = act(F.linear(part, g)) * F.linear(part, u)
        outs.append(F.linear(h, d))
    return torch.cat(outs)


class Experts(nn.Module):
    """The routed experts' weights: (experts, expert_ffn, hidden) gate and up, (experts, hidden, expert_ffn) down."""

    def __init__(self, experts: int, hidden: int, ffn: int, act: Callable):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.act = act

    def forward(self, xs: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return expert_mlp(xs, counts, self.w_gate, self.w_up, self.w_down, self.act)


class MoE(nn.Module):
    def __init__(self, spec, dense: type[nn.Module], act: Callable):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk = spec.experts, spec.experts_per_token, spec.norm_topk
        self.aux_coef = spec.router_aux_coef
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = Experts(spec.experts, spec.hidden, spec.expert_ffn, act)
        shared = spec.shared_expert_ffn
        self.shared = dense(spec, shared, bias=False) if shared else None
        self.shared_gate = nn.Linear(spec.hidden, 1, bias=False) if shared else None
        # (experts, rows sorted by expert, counts per expert as a tensor) -> their outputs; None: all here
        self.dispatch: Callable | None = None
        self.last_aux: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router probabilities (N, E) fp32, top-k weights (N, k) fp32, top-k experts (N, k))."""
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        w = self.router.weight
        flat = x.reshape(-1, shape[-1])
        if flat.dtype != w.dtype and not torch.is_autocast_enabled(flat.device.type):
            flat = flat.to(w.dtype)
        probs, weights, chosen = self.route(flat)
        picks = chosen.reshape(-1)
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=self.num_experts)
        rows = order // self.top_k
        xs = flat[rows]
        if self.dispatch is not None:
            ys = self.dispatch(self.experts, xs, counts)
        else:
            ys = self.experts(xs, counts.tolist())
        ys = ys.float() * weights.reshape(-1)[order].unsqueeze(1)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device).index_add_(0, rows, ys)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        if self.aux_coef and torch.is_grad_enabled():
            share = counts.to(torch.float32) / flat.shape[0]
            aux = self.num_experts * torch.sum(share * probs.mean(dim=0))
            self.last_aux = aux.detach()
            out = AuxLoss.apply(out, aux, self.aux_coef * _AUX_SCALE.get())
        return out.view(shape)
