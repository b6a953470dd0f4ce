"""Investigation (issue 30): what XLA makes of a training step for an
NVIDIA GPU, compiled on a machine without one.

On a GPU, XLA runs a compiled step as CUDA graphs (command buffers). A
conditional inside a graph is a CUDA conditional node, decided on the
device; one between graphs ends the graph before it, and XLA copies its
predicate to the host and waits for the device before it launches a
branch (`ConditionalThunk`). Which of the two a step gets depends on the
jaxlib (its default `--xla_gpu_enable_command_buffer`) and on whether
every operation in the branches can go into a graph. This script builds
`benchmarks/gpu_check.py`'s variants (a random keras-hub `BertBackbone`,
batch 32, sequence 128), trains one step of each on the CPU so that its
optimizer and filters hold their state, compiles its `train_step` for an
H100 ahead of time (JAX's CUDA plugin with a GPU description, no device
and no driver), and reads XLA's thunk sequence from the dump: the graphs
a step launches, the thunks between them, and where each conditional sits.
Then, from the optimized program and its buffer assignment, what each
conditional's branches keep in a buffer that is new at every execution
(`fresh_buffers`): XLA updates a CUDA graph's commands that use a buffer
whose address moved, in every branch of a conditional that holds one.

With `--steps-per-execution N`, the filtered variants' program is
`ASSpeed`'s `lax.scan` of N steps instead (softmax's stays one step: Keras
3.15 loops over N on the host): a `while` loop, whose trip count XLA
knows, so that its `WhileThunk` runs the body N times without reading the
condition back, the script reports.

Needs the CUDA plugin (`pip install "jax[cuda12]"`, Python 3.11 or later).
`XLA_FLAGS` given to the script are passed on (the dump's own flag is
added); the compile is for the jaxlib installed.

    python lab/gpu_program.py --shape minilm
    XLA_FLAGS=--xla_gpu_enable_command_buffer=-CONDITIONAL \\
        python lab/gpu_program.py --variants skip_masked
    python lab/gpu_program.py --variants skip_masked --steps-per-execution 8
"""

import argparse
import collections
import os
import pathlib
import re
import sys
import tempfile

# An H100 SXM as XLA describes a GPU it compiles for (NVIDIA's published
# figures: compute capability 9.0, 132 SMs, 80 GB HBM3 at 3.35 TB/s, 50 MB
# of L2); RESULTS.md's H200 is the same chip with more and faster memory,
# which changes no decision this script reads. A CUDA 13.0 driver (the
# H200's was 580) and the cuda12 plugin's 12.9 runtime: XLA keeps
# conditionals in graphs only from CUDA 12.3 on.
H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability { major: 9 }
  device_vendor: "NVIDIA Corporation"
  name: "NVIDIA H100 80GB HBM3"
  driver_version: "13.0.0"
  runtime_version: "12.9.0"
  compile_time_toolkit_version: "12.9.0"
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""
THUNK = re.compile(r"^( *)\d+: (k\w+)")
BRANCH = re.compile(r"^( *)(\w+_branch|branch_\d+):")


def compile_for_gpu(model, batch, dump, steps=1):
    """Compiles `model.train_step` (with its state donated, as Keras's
    `fit` does) for the H100, or with `steps` > 1 `ASSpeed`'s `lax.scan`
    of that many steps (`steps_per_execution`); returns its thunk
    sequence's path."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    from keras_as_softmax.training import _jax

    topology = topologies.get_topology_desc(
        platform="cuda", target_config=H100, topology="1x1x1"
    )
    sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])

    def spec(value):
        return jax.ShapeDtypeStruct(
            np.shape(value), value.dtype, sharding=sharding
        )

    state = tuple(
        [spec(v.value) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    before = set(dump.glob("*thunk_sequence*.txt"))
    batch = jax.tree.map(spec, batch)
    if steps == 1:
        step, name = jax.jit(model.train_step, donate_argnums=0), "train_step"
        step.lower(state, batch).compile()
    else:
        step, name = _jax.scan(model.train_step), "run"
        step.lower(state, [batch] * steps).compile()
    new = set(dump.glob(f"*{name}*thunk_sequence*.txt")) - before
    # After the thunk passes, where XLA forms the command buffers; without
    # command buffers there is no such file.
    after = [p for p in new if "after_thunk_passes" in p.name]
    return (after or sorted(new))[0]


def read_program(path):
    """The structure of a thunk sequence: the top-level thunks by kind,
    the thunks outside every conditional, for each conditional whether a
    graph holds it and its branches' thunk counts, and for each loop
    (`lax.scan`) whether a graph holds it."""
    top = collections.Counter()
    unconditional = 0
    conditionals, loops = [], []
    stack = []  # (indent, kind or branch name, record)
    for line in path.read_text().splitlines():
        branch = BRANCH.match(line)
        match = THUNK.match(line) or branch
        if not match:
            continue
        indent, kind = len(match[1]), match[2]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            top[kind] += 1
        record = None
        if kind == "kConditional":
            in_graph = any(k == "kCommandBuffer" for _, k, _ in stack)
            record = {"in_graph": in_graph, "branches": []}
            conditionals.append(record)
        elif kind == "kWhile":
            loops.append(any(k == "kCommandBuffer" for _, k, _ in stack))
        elif branch:
            parent = next(
                r for _, k, r in reversed(stack) if k == "kConditional"
            )
            record = {"thunks": 0}
            parent["branches"].append(record)
        elif kind != "kCommandBuffer":
            branches = [r for *_, r in stack if r and "thunks" in r]
            for branch in branches:
                branch["thunks"] += 1
            unconditional += not branches
        stack.append((indent, kind, record))
    return top, unconditional, conditionals, loops


COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*)")
ALLOCATION = re.compile(r"^allocation (\d+): size \d+, (.*)")
VALUE = re.compile(r"^\s*value: <\d+ ([^ @{]+)")


def fresh_buffers(hlo_path, assignment_path):
    """What in each conditional's branches lives in a buffer that is new
    at every execution, from the optimized HLO and its buffer assignment:
    the batch (`train_step`'s second argument, not donated), and the
    step's outputs that XLA did not alias to a donated input (the logs,
    and any state a conditional returned), which XLA also lends to
    smaller values whose lives end before the output's begins. XLA
    records such a command again before each execution.

    Returns `[(name, reads_batch, [values], instructions)]` per
    conditional of the entry computation, in the HLO's order."""
    computation_of, operands, conditionals = {}, {}, []
    entry_params, entry, name = [], None, None
    for line in hlo_path.read_text().splitlines():
        if match := COMPUTATION.match(line):
            name = match[2]
            if match[1]:
                signature = line.split("->")[0]
                entry_params = re.findall(r"(\w[\w.]*): ", signature)
                entry = name
            continue
        if line.startswith("}"):
            name = None
        elif name and (match := INSTRUCTION.match(line)):
            computation_of[match[1]] = name
            call = match[2].split(", metadata=")[0]
            operands[match[1]] = re.findall(r"%([\w.\-]+)", call)
            if " conditional(" in match[2]:
                branches = re.findall(
                    r"(?:true|false)_computation=%([\w.\-]+)", match[2]
                ) or re.findall(
                    r"%([\w.\-]+)",
                    match[2].split("branch_computations=")[-1].split("}")[0],
                )
                conditionals.append((match[1], branches))
    conditionals = [c for c in conditionals if computation_of[c[0]] == entry]
    batch = {p for p in entry_params if p.startswith("args_1")}
    fresh, allocation = set(), None
    for line in assignment_path.read_text().splitlines():
        if match := ALLOCATION.match(line):
            about = match[2]
            param = re.search(r"parameter (\d+)", about)
            allocation = (
                entry_params[int(param[1])] in batch
                if param
                else "maybe-live-out" in about and "output shape" not in about
            )
        elif allocation and (match := VALUE.match(line)):
            fresh.add(match[1])
    found = []
    for name, branches in conditionals:
        inputs = [
            o
            for operand in operands[name]
            for o in [operand, *operands.get(operand, ())]
        ]
        values = sorted(v for v in fresh if computation_of.get(v) in branches)
        size = sum(computation_of[i] in branches for i in computation_of)
        found.append((name, any(i in batch for i in inputs), values, size))
    return found


def trip_counts(hlo_path):
    """The known trip count of each `while` in the optimized HLO, in its
    order (None where XLA does not know it): with one, XLA's `WhileThunk`
    runs the body that many times without reading the condition back."""
    counts = []
    for line in hlo_path.read_text().splitlines():
        if INSTRUCTION.match(line) and " while(" in line:
            known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
            counts.append(int(known[1]) if known else None)
    return counts


def describe(variant, path):
    top, unconditional, conditionals, loops = read_program(path)
    graphs = top.pop("kCommandBuffer", 0)
    outside = ", ".join(f"{k} {n}" for k, n in sorted(top.items())) or "none"
    print(
        f"{variant}: {graphs} CUDA graph(s) at the top; between them: {outside}"
    )
    # Nested conditionals would be counted twice: the step has none.
    sizes = [[b["thunks"] for b in c["branches"]] for c in conditionals]
    fewest = unconditional + sum(min(s) for s in sizes)
    most = unconditional + sum(max(s) for s in sizes)
    print(f"  thunks a step runs: {fewest} (smaller branches) to {most}")
    prefix = path.name.split(".thunk_sequence")[0]
    hlo = path.parent / f"{prefix}.sm_9.0a_gpu_after_optimizations.txt"
    trips = trip_counts(hlo) if hlo.exists() else []
    for i, in_graph in enumerate(loops):
        # Matched in order, where the HLO and the thunks count as many.
        trips_known = len(trips) == len(loops) and trips[i] is not None
        where = (
            "inside a graph (decided on the device)"
            if in_graph
            else f"between graphs, the host runs its body {trips[i]} times "
            "(a known trip count: nothing read back)"
            if trips_known
            else "between graphs (predicate read on the host each iteration)"
        )
        print(f"  loop {i}: {where}")
    for i, record in enumerate(conditionals):
        where = (
            "inside a graph (decided on the device)"
            if record["in_graph"]
            else "between graphs (predicate read on the host)"
        )
        listed = " / ".join(map(str, sizes[i]))
        print(f"  conditional {i}: {where}; thunks per branch {listed}")
    assignment = hlo.with_name(hlo.stem + "-buffer-assignment.txt")
    if hlo.exists() and assignment.exists():
        for name, batch, values, size in fresh_buffers(hlo, assignment):
            new = ["the batch"] * batch + (
                [f"{len(values)} values in unaliased outputs"] * bool(values)
            )
            print(
                f"  {name} ({size} instructions in its branches): "
                f"buffers new at each execution: {', '.join(new) or 'none'}"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shape", choices=("minilm", "bert_base"), default="minilm"
    )
    parser.add_argument(
        "--variants", default="softmax,as_speed,skip_masked,pair"
    )
    parser.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="compile ASSpeed's lax.scan of this many steps (not softmax)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run")
    args = parser.parse_args(argv)

    os.environ.setdefault("KERAS_BACKEND", "jax")
    # Compile for CUDA, run on the CPU: the plugin refuses to start
    # without a driver unless its version check is skipped, and JAX must
    # not open the GPU it does not have.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    dump = pathlib.Path(tempfile.mkdtemp(prefix="gpu_program_"))
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={dump}".strip()
    if os.environ["KERAS_BACKEND"] != "tensorflow":
        # As `benchmarks/gpu_check.py` does: `import tensorflow` now fails,
        # as on a GPU image without it.
        sys.modules["tensorflow"] = None
    import jax
    import numpy as np

    import keras_as_softmax as kas
    from as_softmax_lab import random_bert

    check = random_bert.parse_args(
        ["--quick"]
        if args.quick
        else ["--shape", args.shape, "--samples", "64"]
    )
    (shape,) = check.shapes.values()
    print(f"jax {jax.__version__}; XLA_FLAGS={flags or '(none)'}; dump {dump}")
    x, y = random_bert.make_data(shape["vocabulary_size"], check)
    for variant in args.variants.split(","):
        model = random_bert.make_variant(variant, shape, check)
        inputs = kas.filters.with_sample_ids(x) if variant == "pair" else x
        model.fit(inputs, y, batch_size=32, steps_per_epoch=1, verbose=0)
        batch = jax.tree.map(lambda a: np.asarray(a)[:32], (inputs, y))
        steps = 1 if variant == "softmax" else args.steps_per_execution
        describe(variant, compile_for_gpu(model, batch, dump, steps))


if __name__ == "__main__":
    main()
