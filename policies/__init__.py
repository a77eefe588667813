"""Routing policies: pure decision logic shared by the router service and the simulator.

Importing this package registers every built-in policy (``policies.base.policy_names()`` lists them).
"""

from policies import (  # noqa: F401  (imported for their @register side effect)
    least_load,
    round_robin,
    ttft,
)
