"""Plain-text tables comparing runs."""

import math

import numpy as np


def _fmt_stats(values, scale=100.0, digits=2):
    values = [
        v
        for v in values
        if v is not None and not (isinstance(v, float) and math.isnan(v))
    ]
    if not values:
        return "n/a"
    values = np.asarray(values, "float64") * scale
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def _table(header, rows):
    widths = [
        max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))
    ]

    def line(r):
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def compare(results, baseline="softmax"):
    """A plain-text table comparing runs, grouped by method.

    Per method (mean ± std over seeds where there are several): final
    validation and test metric (in %), best validation metric, training
    seconds per epoch (compile excluded), optimizer updates, the training
    seconds until the run first reached the *baseline's best* validation
    metric of the same seed (`-` if never), the time ratio of that to the
    baseline's, the epoch-time ratio (all epochs, then the last epoch
    alone: where masking has set in), the ratio of whole runs with
    compilation counted (training plus compile seconds: what the wall
    clock of one `fit` shows), the mean masked ratio over the last
    epoch, the share of the last epoch's samples that went through the
    training forward and backward passes, and the Pearson correlation of
    validation loss and metric.

    Args:
        results: list of `RunResult`.
        baseline: the method the others are compared with.

    Returns:
        str.
    """
    by_method = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)
    base = {r.seed: r for r in by_method.get(baseline, [])}
    metric = results[0].metric_name if results else "metric"
    header = [
        "method",
        "seeds",
        f"val {metric}",
        f"test {metric}",
        "best val",
        "s/epoch",
        "updates",
        "t->base best",
        "t ratio",
        "epoch ratio",
        "last-ep ratio",
        "+compile ratio",
        "masked(last ep)",
        "trained(last ep)",
        "pearson(loss,metric)",
    ]
    rows = []
    base_epoch = (
        np.mean([r.time_per_epoch for r in base.values()]) if base else None
    )
    base_last = (
        np.mean([r.epoch_times[-1] for r in base.values()]) if base else None
    )
    base_whole = (
        np.mean([r.train_time + r.compile_time for r in base.values()])
        if base
        else None
    )
    for name, runs in by_method.items():
        reach, ratios = [], []
        for r in runs:
            if r.seed in base:
                target = base[r.seed].best_val_metric
                t = r.time_to_reach(target)
                tb = base[r.seed].time_to_reach(target)
                reach.append(t)
                ratios.append(t / tb if t is not None and tb else None)
        masked = [
            float(np.nanmean(r.masked_ratio[-r.batches_per_epoch[-1] :]))
            for r in runs
        ]
        pearson = [loss_metric_correlation(r) for r in runs]
        # Share of the epoch's samples that went through the training passes.
        trained = [
            (r.trained_fraction[-1] if r.trained_fraction else 1.0)
            * r.batches_per_epoch[-1]
            / r.steps_per_epoch
            for r in runs
        ]
        epoch = np.mean([r.time_per_epoch for r in runs])
        last = np.mean([r.epoch_times[-1] for r in runs])
        whole = np.mean([r.train_time + r.compile_time for r in runs])
        rows.append(
            [
                name,
                len(runs),
                _fmt_stats([r.val_metric for r in runs]),
                _fmt_stats([r.test_metric for r in runs]),
                _fmt_stats([r.best_val_metric for r in runs]),
                _fmt_stats([r.time_per_epoch for r in runs], 1.0, 1),
                _fmt_stats([r.optimizer_updates for r in runs], 1.0, 0),
                (
                    "-"
                    if not reach or any(t is None for t in reach)
                    else _fmt_stats(reach, 1.0, 1)
                ),
                (
                    "-"
                    if not ratios or any(t is None for t in ratios)
                    else _fmt_stats(ratios, 1.0, 2)
                ),
                (f"{epoch / base_epoch:.2f}" if base_epoch else "-"),
                (f"{last / base_last:.2f}" if base_last else "-"),
                (f"{whole / base_whole:.2f}" if base_whole else "-"),
                _fmt_stats(masked, 100.0, 1) + "%",
                _fmt_stats(trained, 100.0, 0) + "%",
                _fmt_stats(pearson, 1.0, 2),
            ]
        )
    return _table(header, rows)


def loss_metric_correlation(result):
    """Pearson r between validation loss and metric over a run's evaluations
    (`nan` with fewer than 3 evaluations or a constant series)."""
    loss = np.asarray([e["val_loss"] for e in result.evals], "float64")
    metric = np.asarray([e["val_metric"] for e in result.evals], "float64")
    if len(loss) < 3 or loss.std() == 0 or metric.std() == 0:
        return float("nan")
    return float(np.corrcoef(loss, metric)[0, 1])
