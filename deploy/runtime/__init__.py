"""The ground floor: process plumbing every npuserve process runs on (logs, shutdown, the event
loop, the heap, process names, restart policy, CPU priority). It imports no service and nothing
else from `deploy`; services import it, never the CLI, the benches, the launcher, the supervisor
or the flag tables (`tests/test_layering.py`)."""
