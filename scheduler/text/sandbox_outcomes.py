"""What a sandboxed worker process (`sandbox_pool`) sends its pool, and what a job comes to.

A worker says `WorkerReady` once it has set up its job handler; from then on it answers each
job with the handler's `JobAnswer`. `SandboxPool.run` gives the job's `Outcome`: that answer,
or `JobTimedOut` or `WorkerDied` when the worker was stopped or ended. The standard library
only: a render worker imports this beside Jinja and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """A worker's first message: it has set up its handler and takes jobs."""


@dataclass(frozen=True, slots=True)
class JobDone:
    value: object = None  # what the job made (a rendered text), if it makes anything


@dataclass(frozen=True, slots=True)
class JobRefused:
    """The job's input is at fault (a template that fails, a constraint that cannot compile)."""

    message: str
    field: str | None  # the request field at fault, when the handler knows it


@dataclass(frozen=True, slots=True)
class JobTimedOut:
    """The job ran past the pool's time limit: its worker was killed."""


@dataclass(frozen=True, slots=True)
class WorkerDied:
    """The worker ended during the job (a crash, or past its memory)."""


JobAnswer = JobDone | JobRefused  # what a job handler answers
Outcome = JobDone | JobRefused | JobTimedOut | WorkerDied  # what `SandboxPool.run` gives
