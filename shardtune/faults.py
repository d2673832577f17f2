"""Fault injection for reliability tests (see :mod:`shardtune.state_dict.faults`).

The implementation lives in ``state_dict/`` because that package may import nothing else from
shardtune; the checkpoint, training and test code use it through this module.
"""

from shardtune.state_dict.faults import (
    ENV_VAR,
    POINTS,
    FaultSpec,
    InjectedFault,
    fault_point,
    parse_fault,
    set_fault,
)

__all__ = ["ENV_VAR", "POINTS", "FaultSpec", "InjectedFault", "fault_point", "parse_fault", "set_fault"]
