"""The measurement's gradient (``estimator.param_grads``) through the hosts' checkpointing and compile: every trainable
parameter's gradient, the same as without, and every ``.grad`` and the optimizer's state as they were.

The checkpointers are the hosts': ``torch.utils.checkpoint`` reentrant (sd-scripts' SDXL UNet, ``USE_REENTRANT = True``)
and not (every other DiT of both hosts), and Anima's unsloth checkpointer (the double in ``library.tiny_models``,
as library/anima_models.py has it: the block under ``no_grad``, its own ``torch.autograd.backward``)."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from downscale_plugin.mapping.estimator import param_grads

pytestmark = pytest.mark.usefixtures("host_doubles")


def flat_grad(loss, params):
    """The measured gradient as one float64 CPU vector (``param_grads`` per parameter, concatenated)."""
    return torch.cat([g.reshape(-1) for g in param_grads(loss, params)]).to("cpu", torch.float64)


class Lora(nn.Module):
    """A frozen linear with a trainable low-rank update (lora_up not zero: both factors get a gradient)."""

    def __init__(self, width: int, rank: int = 2):
        super().__init__()
        self.org = nn.Linear(width, width).requires_grad_(False)
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.org(x) + self.up(self.down(x))


class Model(nn.Module):
    """An adapter before the checkpointed block (the path to it crosses the checkpoint) and two inside it."""

    def __init__(self, checkpointing: str):
        super().__init__()
        self.embed, self.block_a, self.block_b = Lora(6), Lora(6), Lora(6)
        self.checkpointing = checkpointing

    def block(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.block_b(torch.tanh(self.block_a(x))) * scale

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        from library.tiny_models import UnslothOffloadedGradientCheckpointer

        h = self.embed(x)
        if self.checkpointing == "reentrant":
            h = torch.utils.checkpoint.checkpoint(self.block, h, scale, use_reentrant=True)
        elif self.checkpointing == "non-reentrant":
            h = torch.utils.checkpoint.checkpoint(self.block, h, scale, use_reentrant=False)
        elif self.checkpointing == "unsloth":
            h = UnslothOffloadedGradientCheckpointer.apply(self.block, h, scale)
        elif self.checkpointing == "compiled":  # --torch_compile / --compile: AOTAutograd's graphs (the eager backend: no compiler)
            h = torch.compile(self.block, backend="aot_eager", dynamic=False)(h, scale)
        else:
            h = self.block(h, scale)
        return (h**2).mean()


def _model(checkpointing: str) -> Model:
    torch.manual_seed(0)
    model = Model(checkpointing)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)  # lora_up away from 0
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=gen).requires_grad_(True)  # the host makes its inputs require grad for checkpointing
    return x, torch.tensor(1.5).requires_grad_(True)


CHECKPOINTING = ["none", "reentrant", "non-reentrant", "unsloth", "compiled"]


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_the_measured_gradient_is_every_parameters_and_leaves_grad_and_the_optimizer_as_they_were(checkpointing):
    model = _model(checkpointing)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 6
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    x, scale = _inputs()
    model(x, scale).backward()  # a micro-batch before: its gradient accumulated in .grad, and an update's optimizer state
    optimizer.step()
    model(*_inputs()).backward()
    grads = [p.grad for p in params]
    kept = [g.clone() for g in grads]
    inputs_grad = (x.grad, x.grad.clone(), scale.grad, scale.grad.clone())
    state = {k: {n: t.clone() if torch.is_tensor(t) else t for n, t in v.items()} for k, v in optimizer.state.items()}
    weights = [p.detach().clone() for p in params]
    reference_model = _model("none")
    reference_model.load_state_dict(model.state_dict())  # the uncheckpointed model at the weights after the update
    params_ref = [p for p in reference_model.parameters() if p.requires_grad]
    reference = torch.autograd.grad(reference_model(*_inputs()), params_ref)
    reference = torch.cat([g.reshape(-1) for g in reference]).double()

    measured = flat_grad(model(x, scale), params)

    assert torch.equal(measured, reference), (measured - reference).abs().max()
    assert all(p.grad is g and torch.equal(g, k) for p, g, k in zip(params, grads, kept, strict=True))
    assert x.grad is inputs_grad[0] and torch.equal(x.grad, inputs_grad[1])  # other leaves of the graph, too
    assert scale.grad is inputs_grad[2] and torch.equal(scale.grad, inputs_grad[3])
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    assert all(torch.equal(optimizer.state[p][n], state[p][n]) for p in state for n in state[p] if torch.is_tensor(state[p][n]))


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_a_parameter_without_gradient_measures_zero_and_keeps_no_grad(checkpointing):
    model = _model(checkpointing)
    unused = nn.Parameter(torch.ones(4))
    params = [p for p in model.parameters() if p.requires_grad] + [unused]
    measured = flat_grad(model(*_inputs()), params)
    assert torch.equal(measured[-4:], torch.zeros(4, dtype=torch.float64)) and measured[:-4].abs().sum() > 0
    assert all(p.grad is None for p in params)


def test_what_autograd_grad_measured_through_the_hosts_checkpointers():
    """Why the measurement is a backward: ``autograd.grad`` refuses a reentrant checkpoint on the path to a
    parameter, and answers zeros for the adapters inside the unsloth checkpointer while their gradient goes to ``.grad``."""
    model = _model("reentrant")
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(RuntimeError, match="incompatible with .grad"):
        torch.autograd.grad(model(*_inputs()), params, allow_unused=True)
    model = _model("unsloth")
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(model(*_inputs()), params, allow_unused=True)
    inside = [p for name, p in model.named_parameters() if p.requires_grad and name.startswith("block")]
    assert all(g is None for g, p in zip(grads, params, strict=True) if any(p is q for q in inside))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in inside)


def test_a_backward_that_would_step_the_optimizer_is_refused():
    """A fused backward pass (an optimizer step in each parameter's post-accumulate-grad hook) would run on the
    measurement's backward; none of the hosts' LoRA trainers has one, and the measurement refuses it."""
    model = _model("none")
    params = [p for p in model.parameters() if p.requires_grad]
    stepped = []
    params[0].register_post_accumulate_grad_hook(stepped.append)
    with pytest.raises(RuntimeError, match="post-accumulate-grad hook"):
        flat_grad(model(*_inputs()), params)
    assert not stepped and all(p.grad is None for p in params)
