"""Time to a quality target, as MLPerf Training and DAWNBench judge speed.

A run's time to target is its training seconds (compilation included,
evaluation excluded) until its validation metric first reaches the target.
The target is a fraction (by default 99%) of the best validation metric of
the reference run (softmax) on the same seed. A run that never reaches it
is *not reached*: a failure in every summary, never left out.

`records` turns runs into one JSON-ready record per backend, task, method
and seed; `merge` adds them to a file that earlier runs wrote; `table`
summarises records per backend, task and method.
"""

import json
import math
import statistics

DEFAULT_TARGET = 0.99


def time_to_target(evals, target, clock="seconds"):
    """Seconds until `val_metric >= target` first holds, or `None`.

    Args:
        evals: the run's evaluations in order, dicts with `val_metric` and
            the `clock` key (cumulative training seconds at that point).
        target: the validation metric to reach.
        clock: the key of the seconds. Defaults to `"seconds"`
            (compilation included).
    """
    for e in evals:
        if e["val_metric"] >= target - 1e-12:
            return float(e[clock])
    return None


def target_of(reference_evals, fraction=DEFAULT_TARGET):
    """`fraction` of the best validation metric among `reference_evals`."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(
            f"Expected the target fraction in (0, 1]. Received: {fraction!r}"
        )
    return fraction * max(e["val_metric"] for e in reference_evals)


def records(results, fraction=DEFAULT_TARGET, baseline="softmax", **fields):
    """One record per run of `results` whose seed has a `baseline` run.

    Args:
        results: `RunResult`s (`evals` with `seconds`, `test_metric`).
        fraction: the target as a fraction of the baseline's best
            validation metric, same seed.
        baseline: the reference method.
        **fields: added to every record (`backend`, `task`, `command`...).

    Returns:
        A list of dicts: `method`, `seed`, `target`, `reached`, `seconds`
        (`None` when not reached), `softmax_seconds`, `speedup` (the
        baseline's seconds over the run's; 0.0 when not reached),
        `test_metric`, `softmax_test_metric`, `history` (`[seconds,
        val_metric]` per evaluation) and `fields`.
    """
    base = {r.seed: r for r in results if r.method == baseline}
    out = []
    for r in results:
        if r.seed not in base:
            continue
        ref = base[r.seed]
        target = target_of(ref.evals, fraction)
        seconds = time_to_target(r.evals, target)
        ref_seconds = time_to_target(ref.evals, target)
        out.append(
            {
                **fields,
                "method": r.method,
                "seed": r.seed,
                "target_fraction": fraction,
                "target": target,
                "reached": seconds is not None,
                "seconds": seconds,
                "softmax_seconds": ref_seconds,
                "speedup": ref_seconds / seconds if seconds else 0.0,
                "test_metric": r.test_metric,
                "softmax_test_metric": ref.test_metric,
                "history": [
                    [round(e["seconds"], 2), e["val_metric"]] for e in r.evals
                ],
            }
        )
    return out


def epoch_start_ratios(record, evals_per_epoch=2):
    """Per epoch after the first, the training seconds between an epoch's
    start and its first evaluation over the mean of its other intervals
    between evaluations: about 1 for a steady run, 2 where the steps after
    an epoch's start take twice their time (a stall that an evaluation at
    the end of the previous epoch left behind)."""
    t = [seconds for seconds, _ in record["history"]]
    k = evals_per_epoch
    ratios = []
    for start in range(k, len(t) - k + 1, k):
        first = t[start] - t[start - 1]
        rest = (t[start + k - 1] - t[start]) / (k - 1)
        if rest > 0:
            ratios.append(first / rest)
    return ratios


def _key(record):
    return (
        record.get("backend"),
        record.get("task"),
        record["method"],
        record["seed"],
    )


def merge(path, new_records):
    """Writes `new_records` into the JSON list at `path` (made if missing):
    a record replaces the one of the same backend, task, method and seed.
    Returns every record now in the file."""
    try:
        with open(path) as f:
            old = json.load(f)
    except FileNotFoundError:
        old = []
    merged = {_key(r): r for r in old}
    merged.update({_key(r): r for r in new_records})
    ordered = sorted(merged.values(), key=lambda r: tuple(map(str, _key(r))))
    with open(path, "w") as f:
        json.dump(ordered, f, indent=1)
        f.write("\n")
    return ordered


def _interval95(values):
    """Mean and half-width of a 95% t interval (`nan` below two values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    from scipy import stats

    sem = statistics.stdev(values) / math.sqrt(len(values))
    return mean, stats.t.ppf(0.975, len(values) - 1) * sem


def summarise(group):
    """Over one method's records: seeds reached, median speed-up (a seed
    not reached counts 0x), and the test difference from the baseline in
    points, its mean and 95% interval half-width."""
    speedups = [r["speedup"] for r in group]
    diffs = [100 * (r["test_metric"] - r["softmax_test_metric"]) for r in group]
    mean, half = _interval95(diffs)
    return {
        "seeds": len(group),
        "reached": sum(r["reached"] for r in group),
        "median_speedup": statistics.median(speedups),
        "test_diff": mean,
        "test_diff_95": half,
    }


def table(all_records, baseline="softmax"):
    """A Markdown table: per backend, task and method, the seeds that
    reached the target, the median speed-up to target, the mean test
    difference from softmax with its 95% interval, and the output files."""
    groups = {}
    for r in all_records:
        key = (r.get("backend"), r.get("task"), r["method"])
        groups.setdefault(key, []).append(r)
    lines = [
        "| backend | task | method | seeds reached | median speed-up to "
        "target | test difference, points (95% interval) | output |",
        "|---|---|---|---|---|---|---|",
    ]
    for (backend, task, method), group in sorted(
        groups.items(), key=lambda kv: tuple(map(str, kv[0]))
    ):
        if method == baseline:
            continue
        s = summarise(group)
        half = (
            ""
            if math.isnan(s["test_diff_95"])
            else (f" ± {s['test_diff_95']:.2f}")
        )
        # Links from benchmarks/RESULTS.md, where the table goes.
        outputs = [
            f"[{path.rpartition('/')[2]}]({path.removeprefix('benchmarks/')})"
            for path in sorted({r.get("output", "") for r in group} - {""})
        ]
        lines.append(
            f"| {backend} | {task} | `{method}` | "
            f"{s['reached']}/{s['seeds']} | {s['median_speedup']:.2f}x | "
            f"{s['test_diff']:+.2f}{half} | {', '.join(outputs)} |"
        )
    return "\n".join(lines)
