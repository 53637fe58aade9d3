"""Checks of public functions' arguments, shared so that every refusal reads alike.

Each check raises before anything has changed, and its message names the argument, says
what it got and what to pass instead: TypeError for a value of the wrong kind, ValueError
for one of the right kind out of range. ``hint`` is the "what to do" part, appended as
``"; " + hint``.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["describe", "require_flag", "require_int", "require_real", "require_callable", "require_module",
           "require_iterable"]


def describe(value: object) -> str:
    """A short phrase for what a caller passed: 'a tensor of shape (3, 2)', 'a list of length 2', 'None'."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, (tuple, list, dict)):
        return f"{_article(type(value).__name__)} of length {len(value)}"
    return _article(type(value).__name__)


def _article(name: str) -> str:
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _hinted(message: str, hint: str) -> str:
    return f"{message}; {hint}" if hint else message


def require_flag(name: str, value: object) -> None:
    """Raise TypeError unless ``value`` is True or False (a string such as "no" would count as True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def require_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None,
                hint: str = "") -> None:
    """Raise unless ``value`` is an int (not a bool) in ``[minimum, maximum]`` (either bound may be None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(_hinted(f"{name} must be an int, got {describe(value)}", hint))
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = (f"between {minimum} and {maximum}" if minimum is not None and maximum is not None
                  else f">= {minimum}" if minimum is not None else f"<= {maximum}")
        raise ValueError(_hinted(f"{name} must be an int {bounds}, got {value}", hint))


def require_real(name: str, value: object, *, positive: bool, hint: str = "") -> None:
    """Raise unless ``value`` is a finite real number, > 0 if ``positive`` else >= 0 (NaN and Inf are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(_hinted(f"{name} must be a number, got {describe(value)}", hint))
    if not (0 < value < math.inf if positive else 0 <= value < math.inf):  # NaN fails both comparisons
        raise ValueError(_hinted(f"{name} must be {'> 0' if positive else '>= 0'} and finite, got {value}", hint))


def require_callable(name: str, value: object, hint: str) -> None:
    """Raise TypeError unless ``value`` can be called."""
    if not callable(value):
        raise TypeError(_hinted(f"{name} must be callable, got {describe(value)}", hint))


def require_called_as(name: str, value: object, call: str, arguments: tuple, hint: str) -> None:
    """Raise TypeError unless ``value`` can be called with ``arguments`` (``call`` shows how it will be)."""
    require_callable(name, value, hint)
    try:
        inspect.signature(value).bind(*arguments)
    except TypeError:
        raise TypeError(f"{name} is called as {call}, but it takes {inspect.signature(value)}; {hint}") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass


def require_module(caller: str, value: object, hint: str = "") -> None:
    """Raise TypeError unless ``value`` is an nn.Module: ``caller`` takes the model, not its parameters or a list."""
    if not isinstance(value, nn.Module):
        raise TypeError(_hinted(f"{caller} takes the model (an nn.Module), got {describe(value)}", hint))


def require_iterable(name: str, value: object, hint: str) -> None:
    """Raise TypeError unless ``value`` can be iterated over (a list, a DataLoader, a generator)."""
    if not isinstance(value, Iterable) or isinstance(value, (str, bytes)):
        raise TypeError(_hinted(f"{name} must be an iterable, got {describe(value)}", hint))
