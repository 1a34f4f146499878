"""CoMERA in a Hugging Face ``transformers.Trainer``: one callback.

::

    import comera_engine as ce
    from comera_engine.integrations.huggingface import CoMERACallback

    config = ce.CoMERAConfig(target_compression=20)
    ce.tensorize(model, config, exclude=["classifier"])
    comera = ce.CoMERA(model, config, total_steps=args.max_steps)
    opt = torch.optim.AdamW(comera.param_groups(), lr=args.learning_rate)
    trainer = Trainer(model=model, args=args, train_dataset=train,
                      optimizers=(opt, None),
                      callbacks=[CoMERACallback(comera)])
    trainer.train()
    comera.report()["message"]          # "target 20x · reached 20.1x (+0 %)"

The Trainer owns the loop, so the controller's two calls go where it lets them:

* **the loss**: while the model trains, a forward hook on it hands the loss the model
  returns (``outputs.loss``: the model computes it from ``labels``, the Trainer's
  default) through :meth:`~comera_engine.CoMERA.loss`, which adds the current stage's
  rank terms; evaluation (``model.eval()``) sees the task loss alone. A loss computed
  outside the model never passes the hook: label smoothing is refused; do not give the
  Trainer a ``compute_loss_func``.
* **the step**: after every optimizer step (``on_step_end``) the callback calls
  :meth:`~comera_engine.CoMERA.step` with the Trainer's optimizer: gates, stage switch,
  pace, and the truncation of the cores and of the optimizer's state.

The optimizer must come from :meth:`~comera_engine.CoMERA.param_groups` (each group its
own learning rate; the gates need theirs): the Trainer's default one, built over the
model's parameters at one rate, is refused in one line naming the fix. The Trainer's
learning-rate schedule scales every group but the gates (CoMERA keeps their rate);
``optimizers=(opt, ce.lr_scheduler(opt, "linear", comera=comera))`` holds the others
until the pace fixes the ranks, then decays them. Under DDP (several processes) the
plateau and the late stage's ``λ`` are judged on the loss averaged over the processes,
as in any loop; shapes must not change under the live wrapper, so dead rank entries stay
masked while the Trainer trains and are sliced out of the model and the optimizer's
state when it ends (``comera train`` instead rebuilds its wrapper to truncate as it
goes). ``load_best_model_at_end`` is refused: the model shrinks as it trains, so an
earlier checkpoint holds other ranks than the model at the target.

**Gradient accumulation.** Each micro-batch's loss goes through the hook and the Trainer
divides it by the number of micro-batches, so the rank terms count once per optimizer
step and the plateau is judged on the micro-batches' mean loss (the late stage's ``λ`` is
chosen per micro-batch, from its loss). A model that takes loss keyword arguments
(``**kwargs`` in its ``forward``, most of transformers' models) is instead handed
``num_items_in_batch`` and normalises its own loss over the whole accumulation, which the
Trainer then leaves unscaled: its first micro-batch is refused in one line, naming the
fix (``model.accepts_loss_kwargs = False`` before building the Trainer: the loss of each
micro-batch is then its own mean, averaged by the Trainer).

**Keeping the small model.** ``ce.save(model, path)`` and later
``ce.load_into(ModelClass(config), path)``: ``from_pretrained`` builds the dense
architecture and would leave every tensorized layer at its random initialisation.

**Resuming.** With every checkpoint the Trainer saves, the callback writes the
controller's state beside it (``comera_state.json``: stage, plateau, pace plan, steps,
every TT layer's ranks). The Trainer loads a checkpoint into the model as it is built, so
shape the fresh model first::

    callback = CoMERACallback(comera)
    callback.restore(checkpoint)       # TT layers at the saved ranks, the controller's state
    opt = torch.optim.AdamW(comera.param_groups())
    trainer = Trainer(..., optimizers=(opt, None), callbacks=[callback])
    trainer.train(resume_from_checkpoint=checkpoint)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..errors import ConfigError
from ..rank import CoMERA
from ..store.layout import write_atomic

__all__ = ["STATE_FILE", "CoMERACallback"]

STATE_FILE = "comera_state.json"
"""The controller's state, written into each of the Trainer's checkpoint folders."""


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper (which proxies its state; it is an
    ``Optimizer`` subclass without the base's hooks, so unwrap while it holds one)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


class CoMERACallback(TrainerCallback):
    """Runs ``comera`` (a :class:`~comera_engine.CoMERA` over the model the Trainer
    trains) inside ``transformers.Trainer`` (see the module doc). :attr:`events` keeps
    what the controller did, as ``comera.events`` does."""

    def __init__(self, comera: CoMERA) -> None:
        self.comera = comera
        self._hook: Any = None
        self._accumulating = False  # the Trainer accumulates gradients over micro-batches
        self._distributed = False  # several processes: the model under a DDP wrapper

    @property
    def events(self) -> list:
        return self.comera.events

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        comera = self.comera
        self._distributed = getattr(args, "world_size", 1) > 1
        if model is not None and model is not comera.model and not any(
                m is comera.model for m in model.modules()):
            raise ConfigError("model", "the Trainer trains another model than the one "
                                       "given to ce.CoMERA: pass that one to both")
        self._accumulating = getattr(args, "gradient_accumulation_steps", 1) > 1
        steps = getattr(state, "max_steps", 0) or 0
        if comera.total_steps and steps and steps != comera.total_steps:
            short = ", so this run ends short of it" if steps < comera.total_steps else ""
            print(f"CoMERA: ce.CoMERA(total_steps={comera.total_steps:,}) but the Trainer runs "
                  f"{steps:,} steps: the ranks are planned to reach the target within "
                  f"total_steps{short}; give total_steps=trainer.args.max_steps (or the steps "
                  "its epochs make)", file=sys.stderr)
        if getattr(args, "load_best_model_at_end", False):
            raise ConfigError("load_best_model_at_end", "the model shrinks as it trains, so "
                                                        "a best checkpoint from before the "
                                                        "end holds other ranks than the "
                                                        "model at the target: set "
                                                        "load_best_model_at_end=False")
        if getattr(args, "label_smoothing_factor", 0.0):
            raise ConfigError("label_smoothing_factor", "label smoothing computes the loss "
                                                        "outside the model, where the rank "
                                                        "terms are added: set "
                                                        "label_smoothing_factor=0")
        self._check_optimizer(optimizer)
        if optimizer is not None:  # before the first step: the Trainer's scheduler (its
            comera._hook_optimizer(_inner(optimizer))  # state restored on a resume) moves rates
        if self._hook is None:
            self._hook = comera.model.register_forward_hook(self._add_rank_terms,
                                                             with_kwargs=True)

    def _check_optimizer(self, optimizer: Any) -> None:
        """The optimizer's groups are :meth:`~comera_engine.CoMERA.param_groups`' (the
        gates in their own, at their own rate), or the run would not prune as planned."""
        if optimizer is None:
            return
        gates = {id(p) for g in self.comera.param_groups() if g["name"] == "gates"
                 for p in g["params"]}
        for group in _inner(optimizer).param_groups:
            if group.get("name") != "gates" and any(id(p) in gates for p in group["params"]):
                raise ConfigError(
                    "optimizers", "the Trainer's optimizer trains the rank gates at the "
                                  "model's rate; pass optimizers=(torch.optim.AdamW("
                                  "comera.param_groups()), None)")

    def _add_rank_terms(self, module: nn.Module, inputs: Any, kwargs: dict[str, Any],
                        output: Any) -> Any:
        if not module.training or not torch.is_grad_enabled():
            return output
        if self._accumulating and kwargs.get("num_items_in_batch") is not None:
            self._remove_hook()  # refused before any backward: nothing trained
            raise ConfigError(
                "gradient_accumulation_steps", "this model normalises its loss over the "
                "whole accumulation (the Trainer hands it num_items_in_batch), so the rank "
                "terms would count once per micro-batch: set model.accepts_loss_kwargs = "
                "False before building the Trainer (each micro-batch's loss its own mean, "
                "averaged by the Trainer), or use 1")
        if isinstance(output, dict) and output.get("loss") is not None:
            output["loss"] = self.comera.loss(output["loss"])
            return output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor) \
                and output[0].dim() == 0:
            return (self.comera.loss(output[0]), *output[1:])
        return output

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                    **kwargs: Any) -> None:
        # under DDP shapes must not change beneath the live wrapper: dead entries stay
        # masked (as they are between truncations) until the training ends
        self.comera.step(_inner(optimizer) if optimizer is not None else None,
                         truncate=not self._distributed)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Beside the checkpoint the Trainer just wrote: the controller's state."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if folder.is_dir() and state.is_world_process_zero:
            write_atomic(folder / STATE_FILE, json.dumps(self.comera.state_dict(), indent=1))

    def restore(self, checkpoint: str | os.PathLike[str]) -> None:
        """Before ``trainer.train(resume_from_checkpoint=checkpoint)``: the TT layers
        reshaped to the checkpoint's ranks and the controller's state restored (from the
        ``comera_state.json`` :meth:`on_save` wrote there).

        Raises:
            ConfigError: the folder holds no controller state.
        """
        path = Path(checkpoint) / STATE_FILE
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError("resume_from_checkpoint",
                              f"{path} is missing or unreadable ({type(e).__name__}): resume "
                              "from a checkpoint the Trainer saved with CoMERACallback") from e
        self.comera.load_state_dict(state)

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                     **kwargs: Any) -> None:
        self._remove_hook()
        if self._distributed:
            # the wrapper is done with: the model and the optimizer's state slice down to
            # the live entries, as one process's run did step by step
            self.comera.truncate(_inner(optimizer) if optimizer is not None else None)

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
