"""npuserve's benchmarks: `npuserve bench` (serving, `serving`), `npuserve bench-runner` (the
ModelRunner's decode, `runner`), `npuserve bench-scale` (one scheduler over many simulated
executors, `scale`), the simulated-executor fleet they start (`simulated_fleet`) and the one
report module they share (`report`). Reference results live in the repository's `docs/results/`."""
