"""The chart's ``config.workers``: the router gets KVROUTE_WORKERS and one core per worker (real helm binary)."""

from __future__ import annotations

from tests.integration.test_helm_chart import render, router_container, settings_env


def test_workers_set_the_setting_and_cpu_per_worker() -> None:
    objects = render(sets={"config.workers": "3"})
    assert settings_env(objects)["KVROUTE_WORKERS"] == "3"
    res = router_container(objects)["resources"]
    assert res["requests"]["cpu"] == "3000m" and res["limits"]["cpu"] == "3000m"
    assert res["requests"]["memory"] == "1Gi"  # only the CPU follows the workers
    res = router_container(render(sets={"config.workers": "2", "workerCpuMillis": "1500"}))["resources"]
    assert res["requests"]["cpu"] == res["limits"]["cpu"] == "3000m"


def test_one_worker_keeps_the_resources_as_given() -> None:
    res = router_container(render())["resources"]
    assert res["requests"]["cpu"] == "500m" and res["limits"]["cpu"] == "2"
