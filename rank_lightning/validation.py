"""Argument checks shared by the callbacks, metrics and functions: a bad value raises at once, naming it.

Every message says which argument was wrong, what it got and what it accepts (``every_n_epochs must be a positive
integer, got 0``; ``unknown stage 'test'; valid choices are: val, train``). A check that passes returns the value
(``self.lr = check_positive("lr", lr)``), as given or, for a list setting, as a tuple. The messages of the package
print their counts with :func:`count_of` (``"1 layer"``, ``"3 layers"``) and their sizes with :func:`mib_text`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "SetupError",
    "check_bool",
    "check_choice",
    "check_choices",
    "check_finite",
    "check_fraction",
    "check_int",
    "check_names",
    "check_non_negative",
    "check_non_negative_int",
    "check_non_negative_ints",
    "check_positive",
    "check_positive_int",
    "check_positive_ints",
    "check_real",
    "check_tolerance_dtype",
    "count_of",
    "mib_text",
]

T = TypeVar("T")

_TOLERANCE_DTYPES = ("input", "float16", "bfloat16", "float32", "float64")

_MIB = 2**20


def count_of(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun`` as the package's messages print a count: ``"1 layer"``, ``"3 layers"``, ``"2 weight
    matrices"`` (``plural`` when it is not ``noun + "s"``)."""
    return f"{number} {noun if number == 1 else plural or noun + 's'}"


def mib_text(size: float) -> str:
    """``size`` bytes in MiB, as every size in the package's messages is printed: 3 significant digits, one decimal
    from 100 MiB (``"0.25"``, ``"42.7"``, ``"98410.2"``); the unit is left to the message."""
    value = size / _MIB
    return f"{value:.1f}" if value >= 100 else f"{value:.3g}"


class SetupError(RuntimeError):
    """Inputs of a run that exist but cannot be used (corrupted data files, weights that cannot be downloaded or do
    not fit the model), with a message that says what to do; the CLI prints it as one line."""


def _is_int(value: Any) -> bool:
    # numbers.Integral: NumPy's integers (an entry of np.array([1, 5])) count; bool does not.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _require(name: str, value: T, ok: Callable[[Any], bool], kind: str, allow_none: bool) -> T:
    if not (allow_none and value is None) and not ok(value):
        raise ValueError(f"{name} must be {kind}{' or None' if allow_none else ''}, got {value!r}")
    return value


def check_bool(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False`` (or ``None`` when ``allow_none``).

    A truthy stand-in is refused: ``"no"`` or ``"false"`` would otherwise switch an option on, ``1`` or ``0`` pass
    unnoticed for what may be a misplaced count. NumPy's ``bool_`` counts.
    """
    return _require(name, value, lambda v: isinstance(v, (bool, np.bool_)), "True or False", allow_none)


def check_positive_int(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is an ``int >= 1`` (or ``None`` when ``allow_none``)."""
    return _require(name, value, lambda v: _is_int(v) and v >= 1, "a positive integer", allow_none)


def check_int(name: str, value: T) -> T:
    """Raise ``ValueError`` unless ``value`` is an integer (a seed: any sign; ``bool`` does not count)."""
    return _require(name, value, _is_int, "an integer", False)


def check_non_negative_int(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is an ``int >= 0`` (or ``None`` when ``allow_none``)."""
    return _require(name, value, lambda v: _is_int(v) and v >= 0, "a non-negative integer", allow_none)


def _is_finite_real(value: Any) -> bool:
    # numbers.Real: NumPy's floats count; bool does not.
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def check_finite(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is a finite real number (or ``None`` when ``allow_none``)."""
    return _require(name, value, _is_finite_real, "a finite number", allow_none)


def check_non_negative(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is a finite real number ``>= 0`` (or ``None`` when ``allow_none``)."""
    return _require(name, value, lambda v: _is_finite_real(v) and v >= 0, "a finite number >= 0", allow_none)


def check_positive(name: str, value: T, *, allow_none: bool = False) -> T:
    """Raise ``ValueError`` unless ``value`` is a finite real number ``> 0`` (or ``None`` when ``allow_none``)."""
    return _require(name, value, lambda v: _is_finite_real(v) and v > 0, "a positive number", allow_none)


def check_fraction(name: str, value: Any, *, closed_low: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` lies in ``(0, 1]`` (``[0, 1]`` with ``closed_low``)."""
    # The type first: comparing a string with 0 is a TypeError, not this message.
    if not _is_finite_real(value) or not ((value >= 0 if closed_low else value > 0) and value <= 1):
        interval = "[0, 1]" if closed_low else "(0, 1]"
        raise ValueError(f"{name} must lie in {interval}, got {value!r}")


def _listing(choices: Collection[Any]) -> str:
    return ", ".join(str(choice) for choice in choices)


def check_choice(name: str, value: T, choices: Collection[Any]) -> T:
    """Return ``value`` if it is one of ``choices``; otherwise raise ``ValueError`` listing them."""
    # bool is an int: True must not pass for 1, nor 1 for True.
    if not any(value == choice and type(value) is type(choice) for choice in choices):
        raise ValueError(f"unknown {name} {value!r}; valid choices are: {_listing(choices)}")
    return value


def _entries(values: Any) -> tuple[Any, ...] | None:
    """The entries of a list setting as a tuple; ``None`` for a value that holds no entries (a number)."""
    return tuple(values) if isinstance(values, Iterable) else None


def check_choices(name: str, values: str | Sequence[str], choices: Collection[str]) -> tuple[str, ...]:
    """A non-empty selection from ``choices`` (a single string counts as one entry), without repeats.

    Raises:
        ValueError: an empty selection, an unknown entry or a repeated one; the message lists the valid choices.
    """
    selected = (values,) if isinstance(values, str) else _entries(values)
    if selected is None:
        raise ValueError(f"{name} must be a list of names, got {values!r}; valid choices are: {_listing(choices)}")
    if not selected:
        raise ValueError(f"{name} must name at least one of: {_listing(choices)}")
    unknown = [value for value in selected if value not in choices]
    if unknown:
        raise ValueError(f"unknown {name} {unknown!r}; valid choices are: {_listing(choices)}")
    repeated = sorted({value for value in selected if selected.count(value) > 1})
    if repeated:
        raise ValueError(f"{name} names {repeated} more than once; valid choices are: {_listing(choices)}")
    return selected


def _ints(name: str, values: Any, minimum: int, kind: str, allow_empty: bool) -> tuple[int, ...]:
    selected = (values,) if _is_int(values) else _entries(values)
    if selected is None or any(not _is_int(value) or value < minimum for value in selected):
        selected = None
    if not selected and (selected is None or not allow_empty):
        listing = "" if allow_empty else "a non-empty list of "
        raise ValueError(f"{name} must be {listing}{kind} integers, got {values!r}")
    return tuple(int(value) for value in selected)


def check_positive_ints(name: str, values: int | Sequence[int], *, allow_empty: bool = False) -> tuple[int, ...]:
    """A tuple of positive integers (a single integer counts as one entry).

    Raises:
        ValueError: an entry that is not a positive integer, or an empty sequence unless ``allow_empty``.
    """
    return _ints(name, values, 1, "positive", allow_empty)


def check_metric_ks(name: str, values: int | Sequence[int], metric: str, metrics: Collection[str]) -> tuple[int, ...]:
    """The positive integers ``values`` (:func:`check_positive_ints`), which may be empty only when ``metric``, which
    logs one value per entry, is not among ``metrics`` (``variance_ratio`` and its ``variance_ratio_ks``).

    Raises:
        ValueError: an entry that is not a positive integer, or no entry for a chosen ``metric``.
    """
    ks = check_positive_ints(name, values, allow_empty=True)
    if metric in metrics and not ks:
        raise ValueError(f"metric {metric!r} needs at least one k in {name}")
    return ks


def check_non_negative_ints(name: str, values: int | Sequence[int], *, allow_empty: bool = False) -> tuple[int, ...]:
    """A tuple of non-negative integers, such as class indices (a single integer counts as one entry).

    Raises:
        ValueError: an entry that is not a non-negative integer, or an empty sequence unless ``allow_empty``.
    """
    return _ints(name, values, 0, "non-negative", allow_empty)


def check_names(name: str, values: str | Sequence[str] | None) -> tuple[str, ...] | None:
    """``None``, or a non-empty tuple of non-empty strings (a single string counts as one entry).

    Raises:
        ValueError: an empty sequence or an entry that is not a non-empty string.
    """
    if values is None:
        return None
    selected = (values,) if isinstance(values, str) else _entries(values)
    if not selected or not all(isinstance(value, str) and value for value in selected):
        raise ValueError(f"{name} must be None or a non-empty list of non-empty strings, got {values!r}")
    return selected


def check_real(name: str, x: torch.Tensor) -> None:
    """Refuse a complex tensor: every spectrum here is of real activations and weights (the imaginary part would
    otherwise be dropped, or fail deep inside, without naming the input); ``TypeError`` for anything but a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise ValueError(f"{name} must be real, got {x.dtype}; the spectra here are of real activations and weights")


_FEATURE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_dtype(name: str, value: T, *, allow_none: bool = True) -> T:
    """Return ``value`` if it is a ``torch.dtype`` (or ``None`` with ``allow_none``); otherwise raise ``ValueError``
    naming it and the valid dtypes (a dtype name such as ``"float64"`` is refused, not looked up)."""
    if not (isinstance(value, torch.dtype) or (allow_none and value is None)):
        valid = ", ".join(str(dtype) for dtype in _FEATURE_DTYPES)
        raise ValueError(
            f"{name} must be {'None or ' if allow_none else ''}a torch.dtype, got {value!r}; valid dtypes are: "
            f"{valid} (or an integer torch dtype)"
        )
    return value


def check_tolerance_dtype(value: Any, rank_tolerance: float | None) -> str | torch.dtype | None:
    """``None``, ``"input"`` or a floating ``torch.dtype`` (a dtype name is turned into the dtype): the
    ``tolerance_dtype`` of a monitor, whose epsilon the default rank tolerance takes.

    Raises:
        ValueError: any other value, or a ``tolerance_dtype`` beside an explicit ``rank_tolerance``.
    """
    if value is None:
        return None
    dtype = getattr(torch, value, None) if isinstance(value, str) and value != "input" else value
    if dtype != "input" and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(
            f"unknown tolerance_dtype {value!r}; valid choices are: None, a floating torch.dtype, "
            + ", ".join(repr(c) for c in _TOLERANCE_DTYPES)
        )
    if rank_tolerance is not None:
        raise ValueError(f"rank_tolerance={rank_tolerance} and tolerance_dtype={value!r} exclude each other")
    return dtype
