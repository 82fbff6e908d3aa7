"""The serving bench's variants: what `--mode` or `--compare` names, each a target configuration
run on the same workload.

``colocated`` and ``disaggregated`` compare prefill/decode disaggregation on a mixed load
(`WorkloadConfig.long_prompts`): each launches ``--num-executors`` executors, all mixed, or
``--prefill-executors`` of them prefill and the rest decode, with ``--max-local-prefill-length``
(default: ``--prompt-len-max``) sending the long prompts, and only them, to the prefill ones.
Under a mixed load each also runs a decode-only baseline (`DECODE_ONLY`: the same workload without
its long prompts), so the report can say how far the long prompts move the decode streams' ITL.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from npuserve.deploy.executor_flags import serve_executor_roles

# "grpc-stream": the name "grpc" had when steps could also go as a call each.
VARIANT_KINDS = ("offline", "grpc", "grpc-stream", "caching", "host-tier", "colocated", "disaggregated")
# `--compare host-tier` without --kv-host-memory: a host tier this many times the KV cache.
HOST_TIER_TIMES_CACHE = 4
# Prefill/decode disaggregation's configurations, and the suffix of their decode-only baselines.
DISAGGREGATION_VARIANTS = ("colocated", "disaggregated")
DECODE_ONLY = "-decode-only"


@dataclass(slots=True, frozen=True)
class Variant:
    name: str
    kind: str  # "offline" or "grpc"
    enable_prefix_caching: bool
    kv_host_memory_gib: float | None = None  # None: as --kv-host-memory says
    prefill_executors: int = 0  # a launched server's prefill executors (the rest decode); 0: all mixed
    decode_only: bool = False  # the workload without its long prompts


def parse_variants(args: argparse.Namespace) -> list[Variant]:
    """`--mode` (default: grpc with `--address`, else offline) or the `--compare` list, as variants.

    ``caching`` is two offline variants, prefix caching on and off; ``host-tier`` two with and
    without a host-memory KV tier (--kv-host-memory, else `HOST_TIER_TIMES_CACHE` times the cache);
    ``colocated`` and ``disaggregated`` launched servers, each after its decode-only baseline when
    the workload has long prompts.
    """
    compare, address = args.compare, args.address
    names = (
        [n.strip() for n in compare.split(",")]
        if compare
        else [args.mode or ("grpc" if address else "offline")]
    )
    caching = args.enable_prefix_caching
    variants: list[Variant] = []
    for name in names:
        if name == "offline":
            variants.append(Variant("offline", "offline", caching))
        elif name in ("grpc", "grpc-stream"):
            variants.append(Variant(name, "grpc", caching))
        elif name == "caching":
            variants += [
                Variant("prefix-cache-on", "offline", True),
                Variant("prefix-cache-off", "offline", False),
            ]
        elif name == "host-tier":
            host_gib = args.kv_host_memory or HOST_TIER_TIMES_CACHE * (args.kv_cache_memory or 0.0)
            if not host_gib:
                raise ValueError("--compare host-tier needs --kv-host-memory or --kv-cache-memory")
            variants += [
                Variant("host-tier-on", "offline", caching, host_gib),
                Variant("host-tier-off", "offline", caching, 0.0),
            ]
        elif name in DISAGGREGATION_VARIANTS:
            variants += _disaggregation_variants(name, args)
        else:
            raise ValueError(
                f"unknown variant {name!r} in --compare (choose from {', '.join(VARIANT_KINDS)})"
            )
    if len({v.name for v in variants}) != len(variants):
        raise ValueError(f"--compare names a variant twice: {compare}")
    if address and sum(v.kind == "grpc" for v in variants) > 1:
        raise ValueError("--address serves one gRPC variant; omit it to launch one server per variant")
    return variants


def _disaggregation_variants(name: str, args: argparse.Namespace) -> list[Variant]:
    """``colocated`` or ``disaggregated``, after its decode-only baseline under a mixed load."""
    if args.address:
        raise ValueError(f"--compare {name} launches servers of its own: omit --address")
    prefill = args.prefill_executors if name == "disaggregated" else 0
    if name == "disaggregated":
        serve_executor_roles(args.num_executors, prefill)  # NOTE: the serve command's check
        if prefill < 1:
            raise ValueError("--compare disaggregated needs --prefill-executors >= 1")
        local = max_local_prefill_length(args)
        if args.long_prompts and args.long_prompt_len <= local:
            raise ValueError(
                f"--long-prompt-len {args.long_prompt_len} would prefill where it decodes: "
                f"raise it above --max-local-prefill-length {local}"
            )
    elif args.num_executors < 2:
        raise ValueError("--compare colocated compares with disaggregation: give --num-executors >= 2")
    variant = Variant(name, "grpc", args.enable_prefix_caching, prefill_executors=prefill)
    if not args.long_prompts:
        return [variant]
    return [replace(variant, name=f"{name}{DECODE_ONLY}", decode_only=True), variant]


def max_local_prefill_length(args: argparse.Namespace) -> int:
    """The longest prompt a decode executor prefills itself: ``--max-local-prefill-length``, by
    default the decode streams' longest (``--prompt-len-max``: every long prompt goes to a prefill
    executor)."""
    given: int | None = args.max_local_prefill_length
    return args.prompt_len_max if given is None else given
