"""Protobuf <-> :class:`SamplingParams` (re-exported by :mod:`services.convert`, the one place
messages and dataclasses meet): temperature, top-k, top-p, seed, the penalties and the constraint.

Unset fields take their "off" values (top_p 0 -> 1, repetition_penalty unset -> 1); a value that is
set, however bad (NaN, a negative top_p, a repetition penalty of 0), is passed on as it is, so that
validation refuses it naming the field rather than it silently becoming the default.
"""

from __future__ import annotations

from common.spec.types import Constraint, SamplingParams
from cosine.v1 import common_pb2


def sampling_to_pb(s: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )
    if s.seed is not None:
        pb.seed = s.seed
    if s.repetition_penalty != 1.0:
        pb.repetition_penalty = s.repetition_penalty
    if s.constraint is not None:
        pb.constraint.kind = s.constraint.kind
        pb.constraint.spec = s.constraint.spec
    return pb


def sampling_from_pb(pb: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(pb.temperature),
        top_p=float(pb.top_p) if pb.top_p != 0 else 1.0,
        top_k=int(pb.top_k),
        seed=int(pb.seed) if pb.HasField("seed") else None,
        presence_penalty=float(pb.presence_penalty),
        frequency_penalty=float(pb.frequency_penalty),
        repetition_penalty=float(pb.repetition_penalty) if pb.HasField("repetition_penalty") else 1.0,
        constraint=Constraint(pb.constraint.kind, pb.constraint.spec) if pb.HasField("constraint") else None,
    )
