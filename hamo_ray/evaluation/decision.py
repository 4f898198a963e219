"""The decision rule of the learning experiments (docs/results.md): how a paired interval over seeds is
read, and the seeds a fixed design reads it at (:class:`Plan`). ``hamo_ray.evaluation.report`` applies it
to every paired row of a section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import get_args


def method_names() -> tuple[str, ...]:
    """Every method a config can name (``method.name``)."""
    from hamo_ray.config.experiment import MethodConfig

    return get_args(MethodConfig.model_fields["name"].annotation)


@dataclass(frozen=True)
class Plan:
    """The seeds a fixed design reads the decision rule at: ``default`` for every method, ``methods``
    for those planned on fewer or more (the powered rerun: 6 seeds, ``base`` and ``harness`` 3). A pair
    is read at the smaller plan of its two methods (it cannot have more seeds than that); a method with
    no plan and no default leaves the pair unplanned (read at any seed count)."""

    default: int | None = None
    methods: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One sentence for the report's section ("" without a plan)."""
        if self.default is None and not self.methods:
            return ""
        counts = [f"{self.default} seeds"] if self.default is not None else []
        counts += [f"`{m}` {n}" for m, n in sorted(self.methods.items())]
        return (
            f"The design reads the decision rule at {', '.join(counts)} (a pair: the smaller plan of its "
            "two methods); a pair with fewer seeds in reads *interim* and decides nothing."
        )

    def pair(self, a: str, b: str) -> int | None:
        plans = [n for n in (self.methods.get(a, self.default), self.methods.get(b, self.default)) if n]
        return min(plans) if plans else None

    @classmethod
    def parse(cls, entries: list[str]) -> Plan:
        """From the command line's ``N`` (every method) and ``method=N`` entries.

        Raises:
            ValueError: an entry that is not ``N`` or ``method=N``, an unknown method, a count below 2
                (a paired interval needs two seeds), or two defaults (each named).
        """
        default, methods = None, {}
        for entry in entries:
            method, sep, count = entry.rpartition("=")
            if not count.isdigit() or (sep and not method):
                raise ValueError(f"--planned-seeds {entry!r}: expected N or method=N (e.g. 6 base=3)")
            if method and method not in method_names():
                raise ValueError(
                    f"--planned-seeds {entry!r}: unknown method {method!r}; one of {list(method_names())}"
                )
            if int(count) < 2:
                raise ValueError(f"--planned-seeds {entry}: a paired interval needs at least 2 seeds")
            if not method and default is not None:
                raise ValueError(f"--planned-seeds: two counts for every method ({default} and {count})")
            if method:
                methods[method] = int(count)
            else:
                default = int(count)
        return cls(default, methods)


def plan_of(planned: int | Plan | None) -> Plan:
    """A :class:`Plan` from one count for every method (or none), or the plan itself."""
    return planned if isinstance(planned, Plan) else Plan(planned)


def reading(interval: dict, a: str, b: str, planned: int | None = None, decides: bool = True) -> str:
    """The decision rule of the learning experiments (docs/results.md): a paired difference ``a - b``
    is *decided* when its 95% t interval over seeds excludes 0, *undecided* otherwise; one seed has no
    interval, so it decides nothing. With ``planned`` (the seeds a fixed design reads the rule at) and
    fewer seeds in, the reading is *interim*: it says where the interval lies and decides nothing, since
    reading the rule after every seed and stopping at the first exclusion would decide more often than
    the 95% it states. ``decides=False``: a score the design reports beside the one it decides on (the
    cross-domain rerun decides on retention only); the reading says where the interval lies and never
    decides, at any seed count (reading three scores would decide more often than the stated 95%)."""
    n = interval["n"]
    if n < 2:
        return "one seed"
    if interval["ci_low"] > 0:
        where = f"excludes 0, `{a}` above"
    elif interval["ci_high"] < 0:
        where = f"excludes 0, `{b}` above"
    else:
        where = "includes 0"
    if not decides:
        return f"reported, decides nothing: {where}"
    if planned is not None and n < planned:
        return f"interim ({n} of {planned} seeds): {where}"
    if interval["ci_low"] > 0:
        return f"decided: `{a}` above"
    if interval["ci_high"] < 0:
        return f"decided: `{b}` above"
    return "undecided"
