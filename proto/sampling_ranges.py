"""The valid range of every sampling option: the one definition, checked once on each side.

The scheduler checks a client's parameters against it (naming each field as the client's API
does) and the executor checks every decoded `NewRequest` against it (so a bad plan is refused,
never sampled). No other module restates a range.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from npuserve.proto.step_plan import SamplingOptions

MAX_LOGPROBS = 20  # top logprobs a request may ask per token


class FieldValueError(ValueError):
    """A value a request field cannot take; ``field`` names it (None: no single field)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Bounds:
    """An interval `[low, high]` (`(low, ...` when low_open; high None: unbounded)."""

    low: float
    high: float | None = None
    low_open: bool = False

    def check(self, name: str, value: float) -> None:
        """Raises FieldValueError naming `name` when `value` is outside (or not finite)."""
        too_low = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or too_low or (self.high is not None and value > self.high):
            raise FieldValueError(f"{name} must be in {self}, got {value}", field=name)

    def __str__(self) -> str:
        return (
            f"{'(' if self.low_open else '['}{self.low}, {'inf)' if self.high is None else f'{self.high}]'}"
        )


# Keyed by SamplingOptions field, in the order they are checked. An option set to None is unset.
OPTION_BOUNDS: dict[str, Bounds] = {
    "temperature": Bounds(0),  # 0 is greedy
    "top_p": Bounds(0, 1, low_open=True),
    "top_k": Bounds(0),  # 0 is the whole vocabulary
    "min_p": Bounds(0, 1),
    "presence_penalty": Bounds(-2, 2),
    "frequency_penalty": Bounds(-2, 2),
    "repetition_penalty": Bounds(0, low_open=True),
    "min_tokens": Bounds(0),
    "num_logprobs": Bounds(0, MAX_LOGPROBS),
}


def check_options(options: SamplingOptions, names: Mapping[str, str] | None = None) -> None:
    """Raises FieldValueError for the first option outside its bounds, named by `names` (the
    caller's name for a SamplingOptions field) or else by the field itself."""
    for option, bounds in OPTION_BOUNDS.items():
        value = getattr(options, option)
        if value is not None:
            bounds.check(names.get(option, option) if names else option, value)
