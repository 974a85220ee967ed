"""Tensor descriptors and input specs, checked without numpy: pure header checks need no array library."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infervisor.protocol.constants import (
    DTYPE_ITEMSIZE,
    MAX_NAME_LEN,
    MAX_RANK,
    MAX_SHM_OFFSET,
    MAX_TENSORS,
    SHM_NAME_PATTERN,
    ErrorCode,
)
from infervisor.protocol.errors import ProtocolError, shown


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where an input lies in a POSIX shared-memory object instead of a frame: the object's name and a byte offset."""

    name: str
    offset: int

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map form of this reference."""
        return {"name": self.name, "offset": self.offset}


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """Name, dtype and shape of one raw tensor: in a frame, or in shared memory when `shm` is set (inputs only)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shm: ShmRef | None = None

    @property
    def nbytes(self) -> int:
        """Byte length of the tensor's data (its frame's length when it has one)."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map form of this descriptor."""
        wire: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.shm is not None:
            wire["shm"] = self.shm.to_wire()
        return wire


#: The synthetic data an input may declare (config `inputs[].synthetic`): each distribution's parameters and their
#: defaults (None: required). Drawn seeded for warm-up, golden inputs, the calibration fallback and canaries.
SYNTHETIC_DISTRIBUTIONS: dict[str, dict[str, float | None]] = {
    "normal": {"mean": 0.0, "std": 1.0},
    "uniform": {"low": 0.0, "high": 1.0},
    #: Integers in [low, high) (high excluded, as numpy and torch draw them): token ids, class indices, masks.
    "integers": {"low": 0, "high": None},
}


@dataclass(frozen=True, slots=True)
class Synthetic:
    """How an input's synthetic data is drawn: normal(mean=a, std=b), uniform(low=a, high=b), integers in [a, b)."""

    distribution: str
    a: float
    b: float

    def describe(self) -> str:
        """e.g. `uniform 0..1`, `normal mean 0 std 1`, `integers 0..30521`."""
        if self.distribution == "normal":
            return f"normal mean {self.a:g} std {self.b:g}"
        if self.distribution == "integers":
            return f"integers {self.a:g}..{self.b - 1:g}"
        return f"{self.distribution} {self.a:g}..{self.b:g}"

    def to_config(self) -> dict[str, Any]:
        """The config form, e.g. `{"distribution": "uniform", "low": 0.0, "high": 1.0}`."""
        first, second = SYNTHETIC_DISTRIBUTIONS[self.distribution]
        number = int if self.distribution == "integers" else float
        return {"distribution": self.distribution, first: number(self.a), second: number(self.b)}


#: A bounded dim: (min, max), max None for no upper bound.
DimRange = tuple[int, int | None]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a model accepts for one input: dtype, shape with None for dynamic dims, finiteness.

    A dynamic dim may be bounded: `bounds[i]` is its (min, max) range (max None: no upper bound), or None
    when it takes any size; an empty `bounds` bounds nothing. `synthetic` says how the daemon draws
    inputs of its own for this one (None: seeded N(0, 1) floats, ones for integers). A bounded dim may
    take its sizes in steps: `steps[i]` > 1 admits only min + k * step (a detector taking multiples of 32);
    an empty `steps`, or 1, admits every size of the range. A stepped dim's max is on its steps.
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    allow_non_finite: bool = False
    bounds: tuple[DimRange | None, ...] = ()
    synthetic: Synthetic | None = None
    steps: tuple[int, ...] = ()

    def dim_range(self, index: int) -> DimRange:
        """The sizes dim `index` takes: (n, n) when fixed, its bounds, else (1, None)."""
        fixed = self.shape[index]
        if fixed is not None:
            return fixed, fixed
        bound = self.bounds[index] if index < len(self.bounds) else None
        return bound if bound is not None else (1, None)

    def dim_step(self, index: int) -> int:
        """The step dim `index` takes its sizes in (1: every size of its range)."""
        return self.steps[index] if index < len(self.steps) and self.shape[index] is None else 1

    def takes(self, index: int, size: int) -> bool:
        """Whether dim `index` takes `size`: inside its range and on its steps."""
        low, high = self.dim_range(index)
        return low <= size and (high is None or size <= high) and (size - low) % self.dim_step(index) == 0

    def dim_rule(self, index: int) -> str:
        """The sizes dim `index` takes in words, e.g. `64 + a multiple of 32 up to 640`, `1..64`, `224`."""
        low, high = self.dim_range(index)
        step = self.dim_step(index)
        if step == 1:
            return str(low) if low == high else _range_text((low, high))
        return f"{low} + a multiple of {step}" + ("" if high is None else f" up to {high}")

    def on_step(self, index: int, size: int) -> int:
        """`size` moved into dim `index`'s range, then up onto its steps (a stepped max is on them)."""
        low, high = self.dim_range(index)
        size = _clamp(size, (low, high))
        step = self.dim_step(index)
        return low + -(-(size - low) // step) * step

    def describe(self) -> str:
        """Human form used in INVALID_INPUT messages, e.g. `image float32[*,3,224,224]`, `x float32[1..64,16]` or
        `image float32[*,3,64..640 step 32,64..640 step 32]`."""
        dims = ",".join(_dim_text(d, self.dim_range(i), self.dim_step(i)) for i, d in enumerate(self.shape))
        return f"{self.name} {self.dtype}[{dims}]"

    def config_shape(self) -> list[int | None | list[int | None]]:
        """The shape as config.json writes it: an integer, null (any size), [min, max] (max null: unbounded), or
        [min, max, step]."""
        shape: list[int | None | list[int | None]] = []
        for index, dim in enumerate(self.shape):
            bound = self.bounds[index] if dim is None and index < len(self.bounds) else None
            step = self.dim_step(index)
            if bound is None:
                shape.append(dim)
            else:
                shape.append([bound[0], bound[1]] if step == 1 else [bound[0], bound[1], step])
        return shape

    def example_shape(self, batch: int = 1) -> tuple[int, ...]:
        """A shape this spec accepts: each dynamic dim set to `batch`, moved into its bounds and onto its steps."""
        if not self.bounds:
            return tuple(batch if d is None else d for d in self.shape)
        return tuple(self.on_step(i, batch) for i in range(len(self.shape)))

    def mismatch(self, desc: TensorDesc) -> str | None:
        """Why `desc` does not fit this spec, or None when it does."""
        if desc.dtype != self.dtype:
            return f"input {self.name!r} has dtype {desc.dtype}, expected {self.describe()}"
        if len(desc.shape) != len(self.shape):
            return f"input {self.name!r} has shape {list(desc.shape)}, expected {self.describe()}"
        for want, got in zip(self.shape, desc.shape, strict=True):
            if want is not None and want != got:
                return f"input {self.name!r} has shape {list(desc.shape)}, expected {self.describe()}"
        if self.bounds:
            for index, (bound, got) in enumerate(zip(self.bounds, desc.shape, strict=False)):
                if bound is not None and not (bound[0] <= got and (bound[1] is None or got <= bound[1])):
                    return (
                        f"input {self.name!r} has shape {list(desc.shape)}: dim {index} is {got}, outside its bound "
                        f"{_range_text(bound)} (expected {self.describe()})"
                    )
        for index, got in enumerate(desc.shape if self.steps else ()):
            if self.dim_step(index) > 1 and not self.takes(index, got):
                return (
                    f"dim {index} of input `{self.name}` must be {self.dim_rule(index)}, got {got} "
                    f"(shape {list(desc.shape)}, expected {self.describe()})"
                )
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TensorSpec:
        """A spec from its JSON form (dataclasses.asdict, as LaunchSpec.to_json writes it).

        KeyError, TypeError or ValueError on anything else.
        """
        drawn = raw.get("synthetic")
        synthetic = None if drawn is None else Synthetic(drawn["distribution"], float(drawn["a"]), float(drawn["b"]))
        bounds = tuple(
            None if b is None else (int(b[0]), None if b[1] is None else int(b[1])) for b in raw.get("bounds", ())
        )
        allow = bool(raw.get("allow_non_finite", False))
        steps = tuple(int(step) for step in raw.get("steps", ()))  # absent before dims took steps
        return cls(raw["name"], raw["dtype"], tuple(raw["shape"]), allow, bounds, synthetic, steps)


def _range_text(bound: DimRange) -> str:
    return f"{bound[0]}..{'*' if bound[1] is None else bound[1]}"


def _dim_text(dim: int | None, bound: DimRange, step: int = 1) -> str:
    if dim is not None:
        return str(dim)
    if step > 1:
        return f"{_range_text(bound)} step {step}"
    return "*" if bound == (1, None) else _range_text(bound)


def _clamp(size: int, bound: DimRange) -> int:
    low, high = bound
    return max(low, size if high is None else min(size, high))


#: Dims stay in the int32 range: a larger one is garbage, not a tensor.
_MAX_DIM = 2**31


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def parse_shm(raw: Any, where: str) -> ShmRef:
    """Validate a descriptor's `shm` map: a name `shm_open` takes without its slash, and an offset."""
    if type(raw) is not dict:
        raise _bad(f"{where}.shm must be a map")
    name, offset = raw.get("name"), raw.get("offset")
    # The name becomes a path under /dev/shm in the worker: no slash, no leading dot, nothing else odd.
    if type(name) is not str or SHM_NAME_PATTERN.fullmatch(name) is None:
        raise _bad(f"{where}.shm.name {shown(name)} must match {SHM_NAME_PATTERN.pattern}")
    if type(offset) is not int or not 0 <= offset <= MAX_SHM_OFFSET:
        raise _bad(f"{where}.shm.offset must be an integer of 0..{MAX_SHM_OFFSET}")
    return ShmRef(name, offset)


def parse_descs(
    raw: Any, what: str = "inputs", allow_empty_dims: bool = False, allow_shm: bool = False
) -> tuple[TensorDesc, ...]:
    """Validate the `inputs`/`outputs` array of a header into descriptors.

    Outputs may have empty dims; only inputs (`allow_shm`) may lie in shared memory.
    """
    min_dim = 0 if allow_empty_dims else 1
    if type(raw) is not list:
        raise _bad(f"{what} must be an array")
    if len(raw) > MAX_TENSORS:
        raise _bad(f"{what} has {len(raw)} tensors, limit {MAX_TENSORS}")
    descs: list[TensorDesc] = []
    #: The names of the elements before this one, made at the second element (most requests have one input).
    earlier: set[str] | None = None
    # Element by element, each in the order of docs/protocol.md section 5: map, name, a name used before,
    # dtype, shape, dims, shm. Exact type checks: msgpack only makes plain dict/list/str/int, and
    # `type(x) is int` also refuses bool (an int subclass), so a true/false dim is malformed, not 1/0.
    for index, item in enumerate(raw):
        if type(item) is not dict:
            raise _bad(f"{what}[{index}] must be a map")
        name, dtype, shape = item.get("name"), item.get("dtype"), item.get("shape")
        if type(name) is not str or not 0 < len(name) <= MAX_NAME_LEN:
            raise _bad(f"{what}[{index}].name must be a string of 1..{MAX_NAME_LEN} characters")
        if index:
            if earlier is None:
                earlier = {descs[0].name}
            if name in earlier:
                raise _bad(f"{what}[{index}].name {shown(name)} appears twice")
            earlier.add(name)
        if type(dtype) is not str or dtype not in DTYPE_ITEMSIZE:
            raise ProtocolError(
                ErrorCode.INVALID_INPUT,
                f"{what}[{index}] ({shown(name)}) dtype {shown(dtype)} is not one of {sorted(DTYPE_ITEMSIZE)}",
            )
        if type(shape) is not list or len(shape) > MAX_RANK:
            raise _bad(f"{what}[{index}].shape must be an array of at most {MAX_RANK} dims")
        for dim in shape:
            if type(dim) is not int or not min_dim <= dim < _MAX_DIM:
                raise ProtocolError(
                    ErrorCode.INVALID_INPUT,
                    f"{what}[{index}] ({shown(name)}) shape {shown(shape)}: dims must be integers >= {min_dim}",
                )
        shm_raw = item.get("shm")
        if shm_raw is None:
            descs.append(TensorDesc(name, dtype, tuple(shape)))
        elif allow_shm:
            descs.append(TensorDesc(name, dtype, tuple(shape), parse_shm(shm_raw, f"{what}[{index}]")))
        else:
            raise _bad(f"{what}[{index}] ({shown(name)}) cannot lie in shared memory")
    return tuple(descs)


def check_frames(descs: Sequence[TensorDesc], frame_lengths: Sequence[int], max_frame_bytes: int) -> None:
    """Check one frame per descriptor without `shm`, in order, and that each is shape x itemsize long.

    The size limit holds for tensors in shared memory too: the worker copies them out.
    """
    in_frames = descs if all(d.shm is None for d in descs) else [d for d in descs if d.shm is None]
    if len(in_frames) != len(frame_lengths):
        shared = len(descs) - len(in_frames)
        described = f"{len(in_frames)} tensors in frames" if shared else f"{len(descs)} tensors"
        raise _bad(f"header describes {described} but {len(frame_lengths)} frames follow")
    for desc in descs:
        if desc.nbytes > max_frame_bytes:
            raise ProtocolError(
                ErrorCode.INVALID_INPUT, f"tensor {desc.name!r} is {desc.nbytes} bytes, limit {max_frame_bytes}"
            )
    for desc, length in zip(in_frames, frame_lengths, strict=True):
        expected = desc.nbytes
        if length != expected:
            raise ProtocolError(
                ErrorCode.INVALID_INPUT,
                f"tensor {desc.name!r} frame is {length} bytes, {desc.dtype}{list(desc.shape)} needs {expected}",
            )


def check_against_spec(descs: Sequence[TensorDesc], specs: Sequence[TensorSpec]) -> None:
    """Check the request's tensors are exactly the model's declared inputs."""
    # Clients almost always send the inputs in the declared order: pair them without building maps.
    if len(descs) == len(specs) and all(d.name == s.name for d, s in zip(descs, specs, strict=True)):
        pairs = zip(specs, descs, strict=True)
    else:
        by_name = {d.name: d for d in descs}
        if set(by_name) != {s.name for s in specs}:
            wanted = ", ".join(s.describe() for s in specs)
            raise ProtocolError(
                ErrorCode.INVALID_INPUT, f"inputs {sorted(by_name)} do not match the model's inputs: {wanted}"
            )
        pairs = zip(specs, [by_name[s.name] for s in specs], strict=True)
    for spec, desc in pairs:
        problem = spec.mismatch(desc)
        if problem is not None:
            raise ProtocolError(ErrorCode.INVALID_INPUT, problem)
