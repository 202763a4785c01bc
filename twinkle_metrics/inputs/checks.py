"""Input checks and coercion shared by every built-in metric: clear errors naming the
metric and the field, no device reads, device tensors kept where they are."""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
from typing import Any, Iterator, List, Optional, Sequence, Union

import torch
from torch.types import Device

_state = threading.local()


def host_reads_active() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def host_reads() -> Iterator[None]:
    """Marks reads of CPU tensors that only ever held host-known values (a count built on
    the host, sizes exchanged over gloo): no device is involved, so
    ``testing.forbid_device_waits`` lets them through."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def shape(x: Any) -> list:
    return list(x.shape) if isinstance(x, torch.Tensor) else [len(x)] if isinstance(x, (list, tuple)) else []


def int_tensor(metric: str, field: str, value: Any, device: Device = None) -> torch.Tensor:
    """``value`` (tensor or nested list of ints) as an integer tensor on ``device``."""
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{metric}: {field} must be an integer tensor or a list of ints, got "
                            f"{type(value).__name__} ({e})") from None
    if value.is_floating_point() or value.is_complex():
        raise TypeError(f"{metric}: {field} must have an integer dtype, got {value.dtype} with shape "
                        f"{list(value.shape)}; pass token ids / flags as torch.long")
    if device is not None and value.device != device:
        value = value.to(device, non_blocking=True)
    return value


def as_tensor(value: Any, device: Device = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``torch.as_tensor`` that keeps device tensors where they are (asynchronous move)."""
    if isinstance(value, torch.Tensor):
        if device is not None and value.device != torch.device(device):
            value = value.to(device, non_blocking=True)
        return value if dtype is None else value.to(dtype)
    return from_host(torch.as_tensor(value, dtype=dtype), device)


def from_host(t: torch.Tensor, device: Device = None) -> torch.Tensor:
    """A tensor built from host data, moved to ``device`` without waiting.

    ``torch.tensor(data, device=cuda)`` copies and then synchronises the stream;
    building on the host and copying with ``non_blocking=True`` does not (the source
    is pageable memory, staged by the copy before it returns).
    """
    if device is None or torch.device(device).type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def from_host_all(tensors: Sequence[torch.Tensor], device: Device) -> List[torch.Tensor]:
    """Host tensors of one dtype moved to ``device`` in one non-blocking copy (``from_host``):
    each a view of the moved block, shaped as it was, in order."""
    block = from_host(torch.cat([t.reshape(-1) for t in tensors]), device)
    return [piece.view(t.shape) for t, piece in zip(tensors, torch.split(block, [t.numel() for t in tensors]))]


def real_values(metric: str, field: str, value: Any, allow_bool: bool = False) -> Any:
    """``value`` unchanged, after refusing complex tensors (a cast would drop the imaginary
    part and give finite, wrong numbers) and, unless ``allow_bool``, bool ones (flags are
    not log-probs or values); a list is checked entry by entry."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    for i, v in enumerate(items):
        if isinstance(v, torch.Tensor) and (v.is_complex() or (v.dtype == torch.bool and not allow_bool)):
            where = f"{field}[{i}]" if items is value else field
            raise TypeError(f"{metric}: {where} must hold real numbers, got a {v.dtype} tensor of shape "
                            f"{list(v.shape)}; pass a floating tensor")
    return value


def float_tensor(metric: str, field: str, value: Any, device: Device = None) -> torch.Tensor:
    """``value`` as a tensor: tensors as they are, other numbers as float64.

    Python floats are float64 already; ``torch.as_tensor`` would round them to
    float32. Anything that is not a rectangular array of numbers is a ``TypeError``
    naming ``metric`` and ``field``.
    """
    if isinstance(value, torch.Tensor):
        return as_tensor(real_values(metric, field, value), device)
    try:
        return from_host(torch.as_tensor(value, dtype=torch.float64), device)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"{metric}: {field} must be a tensor or a rectangular (nested) list of numbers, "
                        f"got {type(value).__name__} ({e}); pass a [batch, seq] tensor") from None


def floating_tensor(metric: str, field: str, value: Any) -> torch.Tensor:
    """``value`` itself, which must be a floating-point tensor (model outputs such as logits)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{metric}: outputs[{field!r}] must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{metric}: outputs[{field!r}] must be a floating tensor, got {value.dtype} "
                        f"with shape {list(value.shape)}")
    return value


def right_align(metric: str, field: str, value: torch.Tensor, target: Sequence[int], what: str) -> torch.Tensor:
    """Keep the last ``target[-1]`` positions of ``value`` (Twinkle aligns labels to the right
    when logits are shorter); raise when the shapes cannot be aligned."""
    want = list(target)
    got = list(value.shape)
    if got == want:
        return value
    if len(got) == len(want) and len(got) >= 1 and got[:-1] == want[:-1] and got[-1] >= want[-1]:
        return value[..., got[-1] - want[-1]:]
    raise ValueError(f"{metric}: {field} {got} do not match {what}; expected {want} (or the same "
                     f"leading dims and at least {want[-1] if want else 0} positions, aligned to the "
                     f"right); pass {field} aligned to the outputs")


_I64 = 2 ** 63


def fits_int64(metric: str, field: str, value: int) -> int:
    """A Python int that an int64 state (and a float64 one, approximately) can hold."""
    if not -_I64 <= value < _I64:
        text = str(value)
        shown = text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"
        raise ValueError(f"{metric}: {field} = {shown} does not fit in 64 bits; pass a count below 2**63")
    return value


def scalar(metric: str, field: str, value: Any, numel: int = 1) -> Any:
    """A Python number or a tensor with ``numel`` elements, returned as is (no read)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        got = "a complex number" if isinstance(value, numbers.Complex) else type(value).__name__
        raise TypeError(f"{metric}: {field} must be a real number or a tensor, got {got}")
    if isinstance(value, numbers.Integral):
        fits_int64(metric, field, int(value))
    if isinstance(value, torch.Tensor):
        if value.numel() != numel:
            want = "a scalar" if numel == 1 else f"{numel} elements"
            raise ValueError(f"{metric}: {field} must be {want}, got a tensor of shape {list(value.shape)}")
        real_values(metric, field, value)
        return value.reshape(-1)[0] if numel == 1 else value.reshape(-1)
    if numel != 1:
        raise ValueError(f"{metric}: {field} must have {numel} elements, got a single number")
    return value


def count(metric: str, field: str, value: Any) -> Any:
    """A count given by the user (tokens, samples, a completion's length): a non-negative
    integer, returned as given (a tensor as its one element, not read from a device).

    Checked where no device wait is needed: Python numbers and host tensors by value (an
    integral float such as ``loss_mask.sum().item()`` is a count; NaN and inf pass, for the
    metric's ``nan_policy``); a device tensor must have an integer dtype (its values are
    checked where the states are reduced). Raises ``TypeError`` / ``ValueError`` naming
    ``metric`` and ``field``.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        got = "a bool" if isinstance(value, bool) else type(value).__name__
        raise TypeError(f"{metric}: {field} must be a count (a non-negative int or an integer tensor), got {got}")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{metric}: {field} must be one count, got a {value.dtype} tensor of shape "
                            f"{list(value.shape)}")
        if value.device.type != "cpu":
            if value.is_floating_point():
                raise TypeError(f"{metric}: {field} is a {value.dtype} tensor on {value.device}; a count on the device "
                                "must have an integer dtype (its values cannot be checked without a device wait): "
                                "pass it as .long(), or a host number")
            return value.reshape(-1)[0]
        with host_reads():
            number = value.reshape(-1)[0].item()
        _check_count(metric, field, number)
        return value.reshape(-1)[0]
    _check_count(metric, field, value)
    if isinstance(value, numbers.Integral):
        fits_int64(metric, field, int(value))
    return value


def counts(metric: str, field: str, values: torch.Tensor) -> torch.Tensor:
    """``values``, a 1-D tensor of counts (completion lengths), checked as ``count`` checks
    one: by value on the host, by dtype on a device."""
    if values.device.type != "cpu":
        if values.is_floating_point():
            raise TypeError(f"{metric}: {field} is a {values.dtype} tensor on {values.device}; counts on the device "
                            "must have an integer dtype (their values cannot be checked without a device wait): "
                            "pass them as .long(), or host numbers")
        return values
    with host_reads():
        v = values.detach()
        bad = v < 0
        if v.is_floating_point():
            bad = bad | (torch.isfinite(v) & (v != v.floor()))
        where = bad.nonzero().flatten().tolist()
        number = v[where[0]].item() if where else None
    if where:
        raise ValueError(f"{metric}: {field}[{where[0]}] = {number!r} is not a count; pass non-negative whole "
                         "numbers (the positions or tokens each counts)")
    return values


def _check_count(metric: str, field: str, number: Any) -> None:
    if isinstance(number, numbers.Integral):
        bad = number < 0
    else:
        bad = math.isfinite(number) and (number < 0 or not float(number).is_integer())
    if bad:
        raise ValueError(f"{metric}: {field} = {number!r} is not a count; pass a non-negative integer (the number of "
                         "tokens / samples / positions it counts)")


def negative_count(metric: str, field: str, total: Any, interval: int) -> None:
    """Raise ``ValueError`` when the reduced ``total`` (or smallest value) of counts given as
    device tensors is negative or not whole: every rank holds the same reduced value, so
    every rank raises the same."""
    if isinstance(total, float) and math.isfinite(total) and (total < 0 or not total.is_integer()):
        raise ValueError(f"{metric}: calculate() of interval {interval}: {field} totals {total!r} over the data "
                         "group, which is no count; a count given to accumulate on the device was negative or not "
                         "whole (device tensors are checked here, host ones in accumulate). The interval is kept: "
                         "fix the counts, then reset() this metric")


def f64(value: Any) -> Any:
    """A number or tensor as float64 (tensors stay on their device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return float(value)


def plus(total: Optional[Any], value: Any) -> Any:
    """``total + value``, where a ``total`` of ``None`` means nothing was added yet."""
    return value if total is None else total + value


NAN_POLICIES = ("propagate", "skip")


def nan_policy(metric: str, value: Any) -> str:
    """Check a ``nan_policy`` constructor argument.

    ``"propagate"``: a non-finite value flows into every result it feeds (NaN/inf shows,
    as Megatron's loss does); ``"skip"``: the entry holding it is dropped from every sum,
    mean, min and max. Both count the non-finite entries.
    """
    if not isinstance(value, str) or value not in NAN_POLICIES:
        raise ValueError(f"{metric}: nan_policy must be one of {list(NAN_POLICIES)}, got {value!r}; "
                         "pass nan_policy='propagate' (NaN/inf shows in the results) or 'skip' "
                         "(non-finite entries are dropped and counted)")
    return value


def nonfinite(x: torch.Tensor) -> torch.Tensor:
    """``~isfinite(x)`` as bool; integer tensors are always finite."""
    if not (x.is_floating_point() or x.is_complex()):
        return torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    return ~torch.isfinite(x)


def is_bad(x: Any) -> Union[bool, torch.Tensor]:
    """Whether ``x`` (None, a number or a 0-d tensor) is NaN/inf: a bool or a bool tensor."""
    if x is None:
        return False
    return nonfinite(x) if isinstance(x, torch.Tensor) else not math.isfinite(x)


def as_count(flag: Union[bool, torch.Tensor]) -> Union[int, torch.Tensor]:
    """An ``is_bad`` flag (a host bool or a bool tensor) as a count to add: 0 or 1."""
    return flag.to(torch.int64) if isinstance(flag, torch.Tensor) else int(flag)


def pick(cond: Union[bool, torch.Tensor], a: Any, b: Any, dtype: torch.dtype = torch.float64) -> Any:
    """``a if cond else b`` for a host bool; ``torch.where`` (on the device) for a tensor."""
    if not isinstance(cond, torch.Tensor):
        return a if cond else b
    device = cond.device

    def t(x: Any) -> torch.Tensor:  # a fill kernel for numbers: no host-to-device copy
        return x if isinstance(x, torch.Tensor) else torch.full((), x, dtype=dtype, device=device)
    return torch.where(cond, t(a), t(b))
