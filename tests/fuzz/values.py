"""Hypothesis strategies for the fuzzer: any asyncrl request message, built from its compiled
descriptor (so a field added to a proto is fuzzed by the next run), with adversarial values
(huge, negative, NaN/inf, empty, unicode, ids of other tenants' experiments), and the raw bytes
of bad requests (random, truncated, a valid message cut short)."""

from __future__ import annotations

import json
import math

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

FD = FieldDescriptor
HUGE_TEXT = 1 << 20
"""The longest string a case sends (1 MiB): big enough for every size check, small enough that
a case stays cheap."""
INT32 = (0, 1, -1, 2, 7, 2**31 - 1, -(2**31), 2**30, 10**9)
INT64 = (*INT32, 2**63 - 1, -(2**63), 2**53 + 1)
FLOATS = (0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e30)
TEXTS = (
    "",
    " ",
    "\x00",
    "é",
    "💥",
    "\u202e",
    "a" * 300,
    "../../etc/passwd",
    "*",
    ">",
    "a.b.>",
    "asyncrl.traj.*.train",
    "exp-0000ff",
    "acme.",
    "\n\t",
    "{}",
    "null",
    "127.0.0.1:1",
    "file:///etc",
    "nats-obj://asyncrl_weights/x/v1",
)


def _text(ids: tuple[str, ...]) -> st.SearchStrategy[str]:
    readable = st.characters(exclude_categories=("Cs",))
    return st.one_of(
        st.sampled_from(ids) if ids else st.nothing(),
        st.sampled_from(TEXTS),
        st.text(readable, max_size=40),
        st.integers(1, HUGE_TEXT).map(lambda n: "x" * n),
    )


def _scalar(field: FieldDescriptor, ids: tuple[str, ...]) -> st.SearchStrategy:
    t = field.type
    if t in (FD.TYPE_STRING,):
        return _text(ids)
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        values = st.one_of(st.sampled_from(FLOATS), st.floats())
        if t == FD.TYPE_FLOAT:  # what a float32 can hold
            values = values.map(lambda x: x if not math.isfinite(x) or abs(x) < 3e38 else math.inf)
        return values
    if t == FD.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, 99, 2**31 - 1]))
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.integers(0, 2**64 - 1)
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, 2**32 - 1)
    return st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))


def _set(msg: Message, field: FieldDescriptor, value) -> None:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        target = getattr(msg, field.name)
        value_field = field.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_field.message_type is not None:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif field.is_repeated:
        target = getattr(msg, field.name)
        if field.message_type is not None:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif field.message_type is not None:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _field(field: FieldDescriptor, ids, depth: int, overrides) -> st.SearchStrategy:
    if field.name in overrides:
        return overrides[field.name]
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key = _scalar(field.message_type.fields_by_name["key"], ids)
        value_field = field.message_type.fields_by_name["value"]
        value = (
            messages(value_field.message_type, ids, depth + 1, overrides)
            if value_field.message_type is not None
            else _scalar(value_field, ids)
        )
        return st.dictionaries(key, value, max_size=4)
    one = (
        messages(field.message_type, ids, depth + 1, overrides)
        if field.message_type is not None
        else _scalar(field, ids)
    )
    if not field.is_repeated:
        return one
    if field.message_type is not None:
        return st.lists(one, max_size=5)
    if field.type == FD.TYPE_STRING:  # many short strings (many huge ones would be GiBs)
        one_short = st.one_of(st.sampled_from(ids or TEXTS), st.sampled_from(TEXTS))
        many = st.tuples(one_short, st.integers(1000, 20000)).map(lambda vn: [vn[0]] * vn[1])
    else:
        many = st.tuples(one, st.integers(1000, 20000)).map(lambda vn: [vn[0]] * vn[1])
    return st.one_of(st.lists(one, max_size=5), many)


def messages(
    descriptor: Descriptor,
    ids: tuple[str, ...] = (),
    depth: int = 0,
    overrides: dict[str, st.SearchStrategy] | None = None,
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type, each field left unset or set to an adversarial value;
    `ids` are the strings that name real entities (experiments, workers) to mix in;
    `overrides` replaces the strategy of the fields of a name, at any depth (a spec_json made
    from a valid spec, the id of the experiment a worker serves)."""
    cls = GetMessageClass(descriptor)
    if depth > 2:
        return st.just(cls())
    fields = list(descriptor.fields)
    overrides = overrides or {}
    parts = {
        f.name: _field(f, ids, depth, overrides)
        if f.name in overrides
        else st.none() | _field(f, ids, depth, overrides)
        for f in fields
    }

    def build(values: dict) -> Message:
        msg = cls()
        for f in fields:
            if values[f.name] is not None:
                _set(msg, f, values[f.name])
        return msg

    return st.fixed_dictionaries(parts).map(build)


def raw_bytes(valid: st.SearchStrategy[Message]) -> st.SearchStrategy[bytes]:
    """Bytes that are no valid request: random, or a valid request cut short or with a byte
    flipped (invalid UTF-8 in a string, a wrong length prefix)."""

    def cut(args) -> bytes:
        data, where = args
        return data[: int(where * len(data))]

    def flip(args) -> bytes:
        data, where, byte = args
        if not data:
            return bytes([byte])
        i = int(where * (len(data) - 1))
        return data[:i] + bytes([byte]) + data[i + 1 :]

    serialized = valid.map(lambda m: m.SerializeToString())
    fraction = st.floats(0, 1)
    return st.one_of(
        st.binary(min_size=1, max_size=256),
        st.tuples(serialized, fraction).map(cut),
        st.tuples(serialized, fraction, st.sampled_from([0xFF, 0xC3, 0x80, 0x0A, 0x12])).map(flip),
    )


# ---- a spec in JSON, valid but for one field -----------------------------------------------------

SPEC_VALUES = (
    None,
    "",
    -1,
    0,
    2**31,
    2**63,
    10**30,
    1e308,
    -1e308,
    "NaN",
    "Infinity",
    "💥",
    "x" * 10000,
    [],
    {},
    True,
    {"$ref": "#"},
)


def _paths(obj, prefix=()) -> list[tuple[str, ...]]:
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    return out


def _replace(obj: dict, path: tuple[str, ...], value) -> dict:
    obj = json.loads(json.dumps(obj))
    node = obj
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return obj


def spec_jsons(valid: dict) -> st.SearchStrategy[str]:
    """`valid` as JSON with one field (or a new one) set to an adversarial value, or text that
    is no spec at all."""
    paths = _paths(valid)
    value = st.one_of(st.sampled_from(SPEC_VALUES), st.floats(), st.integers(), st.text(max_size=8))
    mutated = st.tuples(st.sampled_from(paths), value).map(
        lambda pv: json.dumps(_replace(valid, *pv))
    )
    extra = st.tuples(st.sampled_from(paths), st.text(min_size=1, max_size=8), value).map(
        lambda pkv: json.dumps(_replace(valid, (*pkv[0][:-1], pkv[1]), pkv[2]))
    )
    junk = st.one_of(
        st.sampled_from(["", "{", "[]", "null", "1", '"x"', "{}", '{"name": 1}']),
        st.text(max_size=64),
    )
    return st.one_of(mutated, extra, junk, st.just(json.dumps(valid)))
