"""Routing policies: pure decision logic shared by the router service and the simulator.

Importing this package registers every built-in policy (``policies.base.policy_names()`` lists them).
"""

from policies import (  # noqa: F401  (imported for their @register side effect)
    consistent_hash,
    dynamo_kv,
    least_load,
    llmd_weighted,
    lora_aibrix,
    lora_dynamo,
    lora_llmd,
    pd_dynamo,
    pd_llmd,
    pd_random,
    pd_smg,
    pd_ttft,
    power_of_two,
    preble_e2,
    random_policy,
    round_robin,
    sglang_cache_aware,
    ttft,
    ttft_cache_first,
)
