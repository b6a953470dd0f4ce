# Sourced by the test scripts: the suites' test files, and pytest's
# common arguments. The tests run in parallel, one pytest-xdist worker per
# core up to four (PYTEST_WORKERS sets the number; 0 runs them in this
# process). Every test seeds itself (conftest.py), so the order they land
# in does not matter.
training_tests=(tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py
    tests/test_custom_filters.py tests/test_host_reads.py
    tests/test_optimizer_window.py)
loss_tests=(tests/test_losses.py tests/test_as_speed_backends.py)
# The training suite's core, a `-k` expression over training_tests: for the
# runs that check the package against another release of a dependency (the
# jax that Python 3.11 gets, Keras's next release), where the whole suite
# already runs on the releases users install. What leans on jax's and
# Keras's internals: the filtered step's invariants (no host read, the same
# weights every time, steps per execution one at a time and in one scan),
# the accumulation window, saving and resuming. (The trainer's other
# features, distribution and keras-hub's tasks train in the full runs.)
core_training="(test_accumulation.py or test_optimizer_window.py"
core_training+=" or test_custom_filters.py or test_host_reads.py"
core_training+=" or steps_per_execution or lax_scan"
core_training+=" or same_weights or reads_no_device or keras_file or resume)"
core_training+=" and not keras_hub"
cores="$(nproc 2>/dev/null || echo 1)"
pytest_args=(-q -p no:cacheprovider -n "${PYTEST_WORKERS:-$((cores < 4 ? cores : 4))}")
