"""The paper's figures from `RunResult`s (matplotlib, imported when used)."""

import numpy as np

from as_softmax_lab.report import loss_metric_correlation


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values, window):
    values = np.asarray(values, "float64")
    if window <= 1 or len(values) < window:
        return values
    kernel = np.ones(window) / window
    valid = ~np.isnan(values)
    num = np.convolve(np.where(valid, values, 0.0), kernel, mode="valid")
    den = np.convolve(valid.astype("float64"), kernel, mode="valid")
    return np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)


def plot_masked_ratio(results, path=None, smooth=5):
    """Masked ratio vs training step per run (paper Fig. 1); saves a PNG.

    Args:
        results: list of `RunResult`.
        path: where to save the PNG (skipped if `None`).
        smooth: moving-average window in steps.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        y = _smooth(r.masked_ratio, smooth)
        x = np.arange(len(y)) + (len(r.masked_ratio) - len(y)) + 1
        label = f"{r.method} (seed {r.seed})"
        if r.method == "softmax":
            label += ", would-mask"
        ax.plot(x, 100 * y, label=label)
    ax.set_xlabel("training step (batch)")
    ax.set_ylabel("masked samples (%)")
    ax.set_title("AS-Softmax masked ratio during training")
    ax.set_ylim(0, 100)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_loss_vs_metric(results, path=None):
    """Validation loss vs validation metric per run, with Pearson r in the
    legend (paper Table 4); saves a PNG.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in results:
        loss = [e["val_loss"] for e in r.evals]
        metric = [100 * e["val_metric"] for e in r.evals]
        corr = loss_metric_correlation(r)
        ax.plot(
            loss,
            metric,
            "o-",
            alpha=0.8,
            label=f"{r.method} (seed {r.seed}): r = {corr:.2f}",
        )
    metric_name = results[0].metric_name if results else "metric"
    ax.set_xlabel("validation loss (each method's own)")
    ax.set_ylabel(f"validation {metric_name} (%)")
    ax.set_title("Validation loss vs metric (Pearson r)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_margins(results, path=None, bins=40):
    """Histogram of `p_target - max p_other` on the test set (paper Fig. 4);
    saves a PNG.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.linspace(-1, 1, bins + 1)
    for r in results:
        ax.hist(
            r.test_margins,
            bins=edges,
            histtype="step",
            linewidth=1.5,
            label=f"{r.method} (seed {r.seed})",
        )
    ax.set_xlabel("p_target - max p_other (test set)")
    ax.set_ylabel("samples")
    ax.set_title("Probability margin of the target")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_time_to_target(records, methods, path=None):
    """Validation metric against training seconds, one line per seed and
    method, with each seed's target; saves a PNG.

    Args:
        records: time-to-target records of one backend and task
            (`as_softmax_lab.time_to_target.records`), with `history`.
        methods: the methods to draw, in order (e.g. softmax and the
            recommended setting).
        path: where to save the PNG (skipped if `None`).

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    targets = {}
    for i, method in enumerate(methods):
        for r in (r for r in records if r["method"] == method):
            seconds, metric = np.asarray(r["history"], "float64").T
            label = (
                method
                if r["seed"]
                == min(q["seed"] for q in records if q["method"] == method)
                else None
            )
            ax.plot(
                seconds,
                100 * metric,
                color=colors[i % len(colors)],
                alpha=0.8,
                label=label,
                marker=".",
                markersize=3,
            )
            targets[r["seed"]] = r["target"]
            if r["reached"]:
                ax.plot(
                    [r["seconds"]],
                    [100 * r["target"]],
                    marker="o",
                    color=colors[i % len(colors)],
                    markerfacecolor="none",
                )
    for target in targets.values():
        ax.axhline(100 * target, color="grey", linewidth=0.5, alpha=0.5)
    low = min(100 * t for t in targets.values()) if targets else 0.0
    ax.set_ylim(low - 15, None)
    ax.set_xlabel("training seconds (compilation included)")
    ax.set_ylabel("validation metric (%)")
    ax.set_title(
        "Time to target: grey lines are each seed's target, circles where "
        "a run first reached it",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
