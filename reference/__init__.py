"""The NumPy reference: the executable form of SPEC.md."""

from .config import PRESETS, Config, Hyper, preset
from .params import initialize, registry
from .precision import round_bf16
from .state import State, StepResult
from .step import forward, loss_and_grads, row_losses, step

__all__ = ["PRESETS", "Config", "Hyper", "preset", "initialize", "registry", "round_bf16",
           "State", "StepResult", "forward", "loss_and_grads", "row_losses", "step"]
