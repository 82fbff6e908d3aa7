"""npuserve's benchmarks: `npuserve bench` (serving, `serving`), `npuserve bench-runner` (the
ModelRunner's decode, `runner`), `npuserve bench-scale` (one scheduler over many simulated
executors, `scale`), the simulated-executor fleet they start (`simulated_fleet`) and the report
modules they share (`report`; `disaggregation_report` for prefill/decode disaggregation under
long prompts). Reference results live in the repository's `docs/results/`."""
