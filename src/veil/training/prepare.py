"""The train job's preparation: everything checked before anything is written (then the run:
:mod:`veil.training.execute` over :mod:`veil.pipeline.loop`), and the ledger header that a resume
checks against.

:func:`prepare_run` loads and checks the data, builds and validates the network, plans the steps
(σ for the whole planned run after the preprocessing release) and refuses a run in which not one
step fits, an unsupported ``--augment``, a precision the device lacks, a model whose outputs mix
examples, or an unusable output folder — all before the run folder exists.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from veil.config import TrainConfig
from veil.distributed.runtime import rank_and_world, refuse_private_preprocessing
from veil.errors import BudgetExhaustedError
from veil.pipeline.budget import allowed_steps, plan_steps
from veil.pipeline.data import prepare
from veil.pipeline.loop import RunPlan
from veil.pipeline.model import assemble, build_net
from veil.pipeline.run_folder import check_out, default_out

if TYPE_CHECKING:
    from torch import nn

__all__ = ["max_rows", "prepare_run", "refuse_unsupported_augment", "run_header"]


def prepare_run(cfg: TrainConfig, out: Path | None, check: bool = True) -> RunPlan:
    from veil.pipeline.public_inputs import refuse_mixing_on_public_inputs
    from veil.precision import autocast

    autocast(cfg.device, cfg.precision)  # a precision the device lacks is refused before anything is written
    prepared = prepare(cfg, streaming=True, units=True, whiten=rank_and_world()[1] == 1)
    refuse_private_preprocessing(prepared.prep.public)  # across ranks: one release is not yet supported
    cfg, data = prepared.cfg, prepared.data
    net = build_net(cfg, data, cfg.seed, whitening=prepared.whitening)
    # The whole model (a fixed feature front included, which the engine never sees) must compute each
    # example's output from that example alone: probed on synthetic inputs of the public input shape,
    # never the private rows, so the verdict depends on no record.
    refuse_mixing_on_public_inputs(assemble(prepared.prep, data.input_shape, net), data, cfg.seed)
    if cfg.stream:
        from veil.pipeline.streaming import refuse_fixed_front

        refuse_fixed_front(assemble(prepared.prep, data.input_shape, net))
    refuse_unsupported_augment(cfg, data, net)
    steps = plan_steps(cfg, prepared.n_planned, prepared.pre_events)  # units, with a privacy unit
    allowed = allowed_steps(cfg, steps.sigma, steps.q, steps.steps_planned, prepared.pre_events)
    if cfg.clip == "adaptive":  # the count's noise must fit inside the step's σ: refused before writing
        from veil.clipping.adaptive import gradient_noise

        gradient_noise(steps.sigma, steps.q * prepared.n_planned / 20)  # B/20, the hook's default
    if allowed == 0:
        raise BudgetExhaustedError(
            "noise_multiplier",
            steps.sigma,
            f"not even one training step fits the target ε = {cfg.epsilon:g}",
            "raise --noise-multiplier or --epsilon, or omit --noise-multiplier to calibrate it",
        )
    out_dir = Path(out if out is not None else (cfg.out or default_out(cfg.dataset)))
    if check:
        check_out(out_dir)
    prepared.cfg = cfg.model_copy(update={"out": str(out_dir)})
    return RunPlan(prepared, net, steps, allowed, out_dir)


def refuse_unsupported_augment(cfg: TrainConfig, data: Any, net: nn.Module) -> None:
    """``--augment K > 1`` only for images and end-to-end models (see veil.augment.multiplicity)."""
    from veil.augment.multiplicity import refuse_unsupported
    from veil.models import FixedFeaturesThenHead, resolve_name

    fixed = isinstance(net, FixedFeaturesThenHead)
    name = resolve_name(cfg.model, data.kind, data.input_shape)
    refuse_unsupported(cfg.augment, data.kind, data.input_shape, name, fixed)


def run_header(plan: RunPlan) -> dict[str, Any]:
    import veil

    cfg, steps = plan.cfg, plan.steps
    return {
        "veil_version": veil.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "accountant": cfg.accountant,
        "neighbouring": "add_or_remove_one",
        "target_epsilon": cfg.epsilon,
        "delta": cfg.delta,
        "noise_multiplier": steps.sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "sampling": "poisson",
        "sampling_rate": steps.q,
        "batch_size": cfg.batch_size,
        "steps_planned": steps.steps_planned,
        "dataset_sha256": plan.data.sha256,
        "n_train": plan.data.n_train,
        "privacy_unit": plan.cfg.privacy_unit,
        "max_rows_per_unit": max_rows(plan) if plan.cfg.privacy_unit else None,
        "preprocessing": plan.prep.method,
        "preprocessing_event": None if plan.prep.event is None else plan.prep.event.to_dict(),
        "whitening_event": None if (w := plan.prepared.whitening) is None else w.event.to_dict(),
        "step_event": steps.step_event.to_dict(),
        "secure_rng": cfg.secure_rng,
    }


def max_rows(plan: RunPlan) -> int:
    """K of a privacy-unit run: the configured one, or the default rule on the batch size."""
    from veil.units import default_max_rows_per_unit

    assert plan.cfg.batch_size is not None
    return plan.cfg.max_rows_per_unit or default_max_rows_per_unit(plan.cfg.batch_size)
