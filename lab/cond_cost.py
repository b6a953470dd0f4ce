"""Investigation (issue 30): on a GPU, does a training pass that a
`lax.cond` leaves untaken still cost, and does a step take its kernels'
time or its dispatch's?

`benchmarks/gpu_check.py` found `ASSpeed` + `SkipMasked()` at 100% masked
as slow as softmax on an H200, though its compiled step runs a third of
softmax's kernels (`lab/gpu_program.py`). This separates XLA from Keras and
the package: plain JAX, a stack of residual feed-forward blocks (MiniLM's
width by default) with a 45-class head, and four programs jitted as Keras's
JAX trainer jits a step (the state donated):

* `full`: a training step (forward, backward, SGD update);
* `score`: the forward pass alone, what a filter's scoring pass costs;
* `skip`: the forward pass, then the training step under `lax.cond` on a
  predicate computed on the device from the scores, which comes out false:
  a filtered step with every sample masked;
* `take`: the same program, its predicate true.

Each runs `--calls` batches a round, `--rounds` rounds interleaved, in
three regimes: `fresh` puts every call's batch on the device anew, as `fit`
does (new buffers: XLA updates a CUDA graph whose addresses changed),
`same` reuses one batch, and `scan` runs `--scan` fresh batches a call in
one program (`lax.scan`), as an on-device `steps_per_execution` would
(compiled for an H100 with jaxlib 0.11.2, the loop runs from XLA's host
runtime, each iteration's body as CUDA graphs: no Python between steps).
Printed per program and batch: wall time (the calls dispatched back to
back, then waited for), host time (the median time a call takes to
return, which is its dispatch), and the wall time over `full`'s. If XLA's
conditional works, `skip` costs about `score`, well under `full`; if
`skip` costs `full`, the untaken branch is paid for. Where the host time
is close to the wall time, the step waits for the host, not for the
device; `scan` then shows what dispatching fewer programs gives back. The
script first checks that `skip` leaves the parameters as they were and
`take` changes them.

    python lab/cond_cost.py
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python lab/cond_cost.py
    python lab/cond_cost.py --quick        # a smoke test on the CPU
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def init_params(key, layers, hidden, classes):
    """Residual blocks scaled so that the activations keep their scale
    through `layers` of them (the losses stay finite at 48)."""
    keys = jax.random.split(key, 2 * layers + 1)
    blocks = [
        (
            jax.random.normal(keys[2 * i], (hidden, 4 * hidden)) * hidden**-0.5,
            jax.random.normal(keys[2 * i + 1], (4 * hidden, hidden))
            * (4 * hidden * layers) ** -0.5,
        )
        for i in range(layers)
    ]
    head = jax.random.normal(keys[-1], (hidden, classes)) * hidden**-0.5
    return blocks, head


def row_losses(params, x, y):
    blocks, head = params
    h = x
    for w_in, w_out in blocks:
        h = h + jax.nn.gelu(h @ w_in) @ w_out
    picked = jnp.take_along_axis(jax.nn.log_softmax(h @ head), y[:, None], 1)
    return -picked[:, 0]


def loss_and_gradients(params, x, y):
    return jax.value_and_grad(lambda p: jnp.mean(row_losses(p, x, y)))(params)


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


# The state is `(params, grads)`, the last training pass's gradients. As
# in `ASSpeed`'s step, the training pass writes its gradients in one
# conditional and the update reads them in another: a conditional that
# took the parameters in and returned them updated would copy them on its
# untaken branch (XLA's copy insertion, on the CPU with jaxlib 0.10.2 and
# 0.12).


def full(state, x, y, threshold):
    params, _ = state
    loss, grads = loss_and_gradients(params, x, y)
    return (sgd(params, grads), grads), loss


def score(state, x, y, threshold):
    return state, jnp.max(row_losses(state[0], x, y))


def filtered(state, x, y, threshold):
    params, grads = state
    hardest = jnp.max(row_losses(params, x, y))
    train = hardest > threshold
    grads = jax.lax.cond(
        train,
        lambda g: loss_and_gradients(params, x, y)[1],
        lambda g: g,
        grads,
    )
    params = jax.lax.cond(train, lambda: sgd(params, grads), lambda: params)
    return (params, grads), hardest


REGIMES = ("fresh", "same", "scan")
FUNCTIONS = {"full": full, "score": score, "skip": filtered, "take": filtered}
# The predicate of `skip` comes out false, that of `take` true.
THRESHOLDS = {
    "full": -np.inf,
    "score": -np.inf,
    "skip": np.inf,
    "take": -np.inf,
}


def scanned(fn):
    """`fn` over a stack of batches in one program; its last output."""

    def run(state, xs, ys, threshold):
        def body(state, batch):
            return fn(state, *batch, threshold)

        state, outs = jax.lax.scan(body, state, (xs, ys))
        return state, outs[-1]

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=int, default=4096, help="batch x sequence"
    )
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--calls", type=int, default=48, help="batches a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scan", type=int, default=8, help="batches a scan")
    parser.add_argument(
        "--quick", action="store_true", help="tiny, for the CPU"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.hidden, args.layers = 64, 16, 2
        args.calls, args.rounds, args.scan = 4, 2, 2
    classes = 45
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__}, device {device.platform}: {device.device_kind}"
    )
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}")
    print(
        f"rows={args.rows} hidden={args.hidden} layers={args.layers} "
        f"classes={classes} calls={args.calls} rounds={args.rounds} "
        f"scan={args.scan}"
    )

    rng = np.random.default_rng(0)
    host_batches = [
        (
            rng.standard_normal((args.rows, args.hidden), dtype=np.float32),
            rng.integers(0, classes, args.rows).astype(np.int32),
        )
        for _ in range(2 * args.scan)
    ]
    host_stacks = [
        tuple(np.stack(a) for a in zip(*host_batches[i::2])) for i in range(2)
    ]
    same_batch = jax.device_put(host_batches[0])
    # One program per function and form: `skip` and `take` share theirs.
    step = {fn: jax.jit(fn, donate_argnums=0) for fn in FUNCTIONS.values()}
    scan = {
        fn: jax.jit(scanned(fn), donate_argnums=0) for fn in FUNCTIONS.values()
    }
    jitted = {}
    for name, fn in FUNCTIONS.items():
        jitted["fresh", name] = jitted["same", name] = step[fn]
        jitted["scan", name] = scan[fn]
    params = init_params(jax.random.key(0), args.layers, args.hidden, classes)
    start = (params, jax.tree.map(jnp.zeros_like, params))

    def fresh_state():
        return jax.tree.map(jnp.copy, start)

    def check(name, changed):
        after, _ = jitted["same", name](
            fresh_state(), *same_batch, THRESHOLDS[name]
        )
        leaves = zip(jax.tree.leaves(after[0]), jax.tree.leaves(start[0]))
        moved = any(not np.array_equal(a, b) for a, b in leaves)
        if moved != changed:
            state = "changed" if moved else "did not change"
            sys.exit(f"{name}: its parameters {state}; expected the opposite")

    check("skip", changed=False)
    check("take", changed=True)

    states = {name: fresh_state() for name in FUNCTIONS}

    def run(regime, name):
        """Seconds per batch: wall, and the median call's dispatch."""
        per_call = args.scan if regime == "scan" else 1
        calls = max(1, args.calls // per_call)
        host = []
        began = time.perf_counter()
        for call in range(calls):
            called = time.perf_counter()
            if regime == "scan":
                batch = jax.device_put(host_stacks[call % 2])
            elif regime == "fresh":
                batch = jax.device_put(host_batches[call % len(host_batches)])
            else:
                batch = same_batch
            states[name], out = jitted[regime, name](
                states[name], *batch, THRESHOLDS[name]
            )
            host.append(time.perf_counter() - called)
        if not np.isfinite(out):
            sys.exit(f"{name}: its loss is {out} after {calls} calls")
        wall = time.perf_counter() - began
        return wall / calls / per_call, statistics.median(host) / per_call

    for regime in REGIMES:  # compile and warm up
        for name in FUNCTIONS:
            run(regime, name)
    times = {(r, n): [] for r in REGIMES for n in FUNCTIONS}
    for _ in range(args.rounds):
        for regime in REGIMES:
            for name in FUNCTIONS:
                times[regime, name].append(run(regime, name))

    print("per batch:")
    print(
        f"{'regime':8}{'program':9}{'wall ms':>10}{'host ms':>10}{'/ full':>9}"
    )
    for regime in REGIMES:
        full_wall = statistics.median(w for w, _ in times[regime, "full"])
        for name in FUNCTIONS:
            wall = statistics.median(w for w, _ in times[regime, name])
            host = statistics.median(h for _, h in times[regime, name])
            print(
                f"{regime:8}{name:9}{wall * 1e3:10.3f}{host * 1e3:10.3f}"
                f"{wall / full_wall:8.2f}x"
            )


if __name__ == "__main__":
    main()
