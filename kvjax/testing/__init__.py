"""Checks for people who write their own cache policy.

    report = kvjax.testing.check_policy(MyPolicy(budget=16))
    print(report)  # one line per check; raises AssertionError naming the failed checks

The checks are the properties every built-in policy is tested for: with a budget that covers the
whole sequence it scores like the full cache, it never keeps more than its budget and its live
bytes match the per-token formula, decode compiles once, and `uses_attention_mass` tells the
truth. They run on a tiny random Llama on any backend (a few seconds on CPU).
"""

from kvjax.testing._policy_checks import CHECKS, CheckResult, PolicyReport, check_policy

__all__ = ["CHECKS", "CheckResult", "PolicyReport", "check_policy"]
