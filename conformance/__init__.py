"""The conformance suite (SPEC section 14): every backend against the
reference, per tensor, with the tolerances of conformance/tolerances.py.

    from . import run_suite
    report = run_suite("mlx", "test", "fp32")
    print(report.table()); print(report.summary()); report.passed
"""

from .suite import Report, Row, run_hypothesis, run_suite
from .tolerances import TOLERANCES, relative_error, tolerance

__all__ = ["Report", "Row", "run_hypothesis", "run_suite", "TOLERANCES", "relative_error",
           "tolerance"]
