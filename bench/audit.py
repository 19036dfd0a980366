"""Audit benchmark: membership inference and one-run canary bounds over ε, and the audit's cost.

    python bench/audit.py                                  # digits, ε ∈ {∞, 8, 3, 1}, 16 shadows
    python bench/audit.py --model mlp --epochs 30 --shadow-models 32 --seeds 0,1

For each ε: the target is trained by veil's pipeline with white-box gradient canaries (Dirac, on
the quietest coordinates), then attacked with the loss threshold and LiRA (shadow models trained by
the same pipeline on random halves of train ∪ held-out). Columns: the accountant's ε (δ = 1e-5),
the one-run ε lower bound at 95%, loss and LiRA AUC, TPR at 1% FPR.

Cost: the plain training run against the one-run audit of it (the same run with the canaries
injected, then scored and turned into a bound), median wall time over ``--repeats`` runs of each,
interleaved; goal ≤ 1.3×. Prints markdown tables (for docs/audit.md and docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _audited_run(setup, w, sigma: float, seed: int, canaries: int | None) -> int:  # type: ignore[no-untyped-def]
    """The one-run audit of a training run: the run with gradient canaries, then the bound."""
    from veil.audit.canaries import GradientCanaries
    from veil.audit.fit import fit
    from veil.mechanisms.rng import SeededSource

    data, cfg = setup.data, setup.cfg
    holder: list[GradientCanaries] = []

    def attach(model, optimizer, engine, inputs) -> None:  # type: ignore[no-untyped-def]
        c = GradientCanaries.design(
            model,
            canaries,  # None: the automatic count, as `veil audit` does
            rng=SeededSource(seed),
            max_grad_norm=cfg.max_grad_norm,
            sample=(inputs, data.y_train),  # the records as the trained part takes them
            expected_batch_size=optimizer.expected_batch_size,
            noise_multiplier=optimizer.noise_multiplier,
        )
        c.attach(optimizer, sampling_rate=engine.sampling_rate)
        holder.append(c)

    fit(setup, data.x_train, data.y_train, w, sigma=sigma, seed=seed, before=attach)
    holder[0].detach()
    holder[0].bound(0.95, delta=cfg.delta)
    return holder[0].count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="logreg", help="default logreg: the model docs/audit.md measured")
    parser.add_argument("--epochs", type=int, default=None, help="default: the tuned preset")
    parser.add_argument("--epsilons", default="inf,8,3,1", help="comma-separated; inf = σ = 0")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--canaries", type=int, default=None, help="default: automatic (quiet coordinates)")
    parser.add_argument("--shadow-models", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats for the cost ratio")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from common import machine_description
    from veil.audit.fit import fit, prepare_audit, sigma_for
    from veil.audit.run import AuditSettings, audit
    from veil.config import make_config

    torch.set_num_threads(args.threads)
    print("## Machine\n")
    for k, v in machine_description().items():
        print(f"- {k}: {v}")
    base: dict[str, object] = {"dataset": args.dataset, "model": args.model}
    if args.epochs is not None:
        base["epochs"] = args.epochs

    rows = []
    for eps_text in args.epsilons.split(","):
        eps = float(eps_text)
        for seed in (int(s) for s in args.seeds.split(",")):
            cfg = {**base, "seed": seed} | ({} if math.isinf(eps) else {"epsilon": eps})
            t0 = time.perf_counter()
            report = audit(
                cfg,
                AuditSettings(
                    attack="all",
                    canaries=args.canaries,
                    shadow_models=args.shadow_models,
                    non_private=math.isinf(eps),
                ),
                write=False,
            )
            mia = report.mia or {}
            attacks = mia.get("attacks", {})
            rows.append(
                (
                    eps_text,
                    seed,
                    report.epsilon_theoretical,
                    report.epsilon_lower_bound,
                    attacks["loss"]["auc"],
                    attacks["loss"]["tpr_at_1pct_fpr"],
                    attacks["lira"]["auc"],
                    attacks["lira"]["tpr_at_1pct_fpr"],
                    report.run["test_accuracy"],
                    (report.canaries or {}).get("count"),
                    time.perf_counter() - t0,
                )
            )
            print(f"  done ε={eps_text} seed={seed} in {rows[-1][-1]:.1f} s", file=sys.stderr)

    print(
        f"\n## Membership inference and canary bounds ({args.dataset}, model {args.model}, "
        f"{args.shadow_models} shadow models, δ = 1e-5)\n"
    )
    print(
        "| target ε | seed | accountant ε | canary ε lower bound (95%) | loss AUC | loss TPR@1%FPR "
        "| LiRA AUC | LiRA TPR@1%FPR | test acc. | canaries | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        theo = "∞" if r[2] is None else f"{r[2]:.3f}"
        print(
            f"| {r[0]} | {r[1]} | {theo} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f} "
            f"| {r[8]:.3f} | {r[9]} | {r[10]:.1f} |"
        )

    # -- cost of the one-run audit against the plain run ---------------------------------------
    cost_rows = []
    for eps_text in ("inf", "3"):
        cfg = make_config({**base, "seed": 0} | ({} if eps_text == "inf" else {"epsilon": float(eps_text)}))
        setup = prepare_audit(cfg, private=eps_text != "inf")
        data = setup.data
        w = np.ones(data.n_train, np.float32)
        sigma = sigma_for(setup, data.n_train)
        assert setup.cfg.max_grad_norm is not None
        plain, audited = [], []
        count = 0
        for rep in range(args.repeats):
            t = time.perf_counter()
            fit(setup, data.x_train, data.y_train, w, sigma=sigma, seed=rep)
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            count = _audited_run(setup, w, sigma, rep, args.canaries)
            audited.append(time.perf_counter() - t)
        p, a = statistics.median(plain), statistics.median(audited)
        cost_rows.append((eps_text, count, p, a, a / p))
    print(f"\n## Cost of the one-run audit ({args.dataset}, model {args.model}, median of {args.repeats})\n")
    print("| target ε | canaries | plain training s | training + canaries + bound s | ratio (goal ≤ 1.3) |")
    print("|---|---|---|---|---|")
    for r in cost_rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
