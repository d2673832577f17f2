"""Reward functions named in a config, called with TRL's signature and checked.

Rule: a reward function is ``module:function`` (``function`` may be a dotted attribute path
inside the module), imported with :func:`importlib.import_module` and read with ``getattr``:
only the module the config names is imported and nothing is evaluated. Each function is called
as TRL's ``GRPOTrainer`` calls one, with keywords: ``f(prompts=[...], completions=[...],
completion_ids=[...], **columns)`` (``columns``: the dataset's other fields, one value per
completion), and returns one number per completion. A function that raises, returns the wrong
number of values, or a value that is not a finite number stops the run with a
:class:`RewardError` naming the function and the sample (for an exception, the first sample that
raises on its own). Rewards are ``[completions, functions]`` fp32, as TRL stores them; weights
default to 1 per function.

A call runs under a contract, so a reward cannot end or stall the run silently: a call that
takes longer than ``timeout_s`` (``grpo.reward_timeout_s``; a ``SIGALRM`` timer in the main
thread interrupts it, as it interrupts ``time.sleep``, socket reads and Python loops) and a call
that exits (``sys.exit``, ``SystemExit``: a library helper can) become a :class:`RewardError` too,
so the rollout's error contract (:func:`shardtune.rl.rollouts.rollout`) raises it on every rank
naming the rank where it happened. Only Ctrl-C (``KeyboardInterrupt``) goes through.
"""

from __future__ import annotations

import importlib
import math
import numbers
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from shardtune.ranks.errors import ShardtuneError
from shardtune.rl.advantages import nanstd, total_rewards

__all__ = ["RewardError", "RewardFunctions", "completion_text", "load_reward_function"]

RewardFn = Callable[..., Sequence[Any]]


def completion_text(completion: Any) -> str:
    """A completion's text, as a reward function gets it: a string, or TRL's conversational
    ``[{"role": "assistant", "content": text}]`` (the last message's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is text or a list of chat messages, got {type(completion).__name__}")


class RewardError(ShardtuneError):
    """A reward function failed or returned something unusable; the message names it and the sample."""


def load_reward_function(spec: str, *, key: str = "rewards") -> RewardFn:
    """The callable ``spec`` names (``"package.module:function"``); ``key`` is the config key the
    error messages name."""
    module_name, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ValueError(f"{key}: {spec!r} is not 'module:function' (e.g. shardtune.rl.toy_rewards:sorted_letters)")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{key}: cannot import module {module_name!r} for {spec!r} ({exc}); "
            "install it or put its directory on PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no {attr!r} (for {spec!r}); check the name")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {spec!r} is a {type(obj).__name__}, not a function")
    return obj


class _OutOfTime(Exception):
    """A reward call ran past its time limit (raised by the ``SIGALRM`` handler inside the call)."""


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise :class:`_OutOfTime` inside the block after ``seconds`` (None, or off the main thread where
    signals cannot be handled: no limit); the previous ``SIGALRM`` handler comes back after."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def out_of_time(signum: int, frame: Any) -> None:
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, out_of_time)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _finite(value: Any) -> bool:
    """Whether ``value`` is a real number with a finite float value (an int beyond float's range is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _excerpt(text: Any, limit: int = 80) -> str:
    s = repr(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


@dataclass(frozen=True)
class RewardFunctions:
    """Named reward functions and their weights (the config's ``module:function`` strings are the names)."""

    names: tuple[str, ...]
    functions: tuple[RewardFn, ...]
    weights: tuple[float, ...]
    timeout_s: float | None = None  # the longest one call may take (None: no limit)

    @classmethod
    def from_config(
        cls, specs: Sequence[str], weights: Sequence[float] | None = None, *, timeout_s: float | None = None
    ) -> RewardFunctions:
        """Load ``specs`` (``module:function`` each); ``weights`` one per function (None: all 1.0);
        ``timeout_s``: the time limit of one call."""
        if isinstance(specs, str) or not specs:
            raise ValueError("rewards: give a list of one or more 'module:function' names")
        functions = tuple(load_reward_function(s, key=f"rewards[{i}]") for i, s in enumerate(specs))
        if weights is None:
            weights = [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(f"reward_weights has {len(weights)} values for {len(specs)} rewards; give one per reward")
        for i, w in enumerate(weights):
            if not _finite(w):
                raise ValueError(f"reward_weights[{i}] must be a finite number, got {w!r}")
        return cls(tuple(specs), functions, tuple(float(w) for w in weights), timeout_s)

    def weight_tensor(self) -> Tensor:
        return torch.tensor(self.weights, dtype=torch.float32)

    @property
    def log_names(self) -> tuple[str, ...]:
        """The names metrics use: each function's name after the ``:`` (TRL's ``__name__``), the
        whole ``module:function`` where two would share one."""
        short = [n.rpartition(":")[2] for n in self.names]
        return tuple(s if short.count(s) == 1 else n for s, n in zip(short, self.names, strict=True))

    def metrics(self, rewards_per_func: Tensor, std_is_zero: Tensor) -> dict[str, float]:
        """TRL's reward logs of a generation batch (every rank's completions): each function's
        ``rewards/<name>/mean`` and ``/std``, the weighted total's ``reward`` and ``reward_std``, and
        ``frac_reward_zero_std`` (the share of completions whose advantage had a zero std; from
        :class:`~shardtune.rl.advantages.Advantages`)."""
        out: dict[str, float] = {}
        for i, name in enumerate(self.log_names):
            out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
            out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i]).item()
        total = total_rewards(rewards_per_func, self.weight_tensor())
        out["reward"] = torch.nanmean(total).item()
        out["reward_std"] = nanstd(total).item()
        out["frac_reward_zero_std"] = std_is_zero.float().mean().item()
        return out

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> Tensor:
        """``[completions, functions]`` fp32 rewards of each completion by each function."""
        n = len(completions)
        columns = dict(columns or {})
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions: give one prompt per completion")
        for name, values in columns.items():
            if name in ("prompts", "completions", "completion_ids"):
                raise ValueError(f"dataset column {name!r} clashes with a reward function argument; rename it")
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
        ids = list(completion_ids) if completion_ids is not None else [[] for _ in range(n)]
        out = torch.empty(n, len(self.functions), dtype=torch.float32)
        for j, (name, fn) in enumerate(zip(self.names, self.functions, strict=True)):
            out[:, j] = torch.tensor(self._call(name, fn, prompts, completions, ids, columns), dtype=torch.float32)
        return out

    def _call(self, name, fn, prompts, completions, ids, columns) -> list[float]:
        n = len(completions)

        def call(rows: Sequence[int]) -> Any:
            return fn(
                prompts=[prompts[i] for i in rows],
                completions=[completions[i] for i in rows],
                completion_ids=[ids[i] for i in rows],
                **{k: [v[i] for i in rows] for k, v in columns.items()},
            )

        try:
            with _time_limit(self.timeout_s):
                values = list(call(range(n)))
        except _OutOfTime:
            raise RewardError(
                f"reward function {name!r} did not return within grpo.reward_timeout_s={self.timeout_s} s on a batch "
                f"of {n} completions (first prompt {_excerpt(prompts[0])}); make it faster or raise the limit"
            ) from None
        except SystemExit as exc:
            raise RewardError(
                f"reward function {name!r} called sys.exit({exc.code!r}) (raised SystemExit) on a batch of {n} "
                "completions: a reward must return one number per completion; catch the exit in the function"
            ) from None
        except Exception as exc:
            raise RewardError(self._raised(name, exc, call, prompts, completions)) from exc
        if len(values) != n:
            raise RewardError(
                f"reward function {name!r} returned {len(values)} values for {n} completions; return one per completion"
            )
        for i, v in enumerate(values):
            if not _finite(v):
                raise RewardError(
                    f"reward function {name!r} returned {v!r} for sample {i} (prompt {_excerpt(prompts[i])}, "
                    f"completion {_excerpt(completions[i])}); return a finite number for every completion"
                )
        return [float(v) for v in values]

    def _raised(self, name: str, exc: Exception, call, prompts, completions) -> str:
        """The error of a call that raised, with the first sample that raises alone (within one time limit)."""
        head = f"reward function {name!r} raised {type(exc).__name__}: {exc}"
        try:
            with _time_limit(self.timeout_s):
                for i in range(len(completions)):
                    try:
                        call([i])
                    except (Exception, SystemExit):  # noqa: BLE001 - looking for the sample that raises alone
                        return (
                            f"{head}; sample {i} raises on its own (prompt {_excerpt(prompts[i])}, "
                            f"completion {_excerpt(completions[i])})"
                        )
        except _OutOfTime:
            return f"{head}; (the samples one by one did not finish within grpo.reward_timeout_s={self.timeout_s} s)"
        return f"{head}; on the batch of {len(completions)} samples (no single sample raises on its own)"
