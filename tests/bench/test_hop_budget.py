"""bench/hop.py's own instruments: the budget by difference and the profile folding."""

from __future__ import annotations

from bench.hop import budget, fold_profile


def _rows(load: str, **cpu: float) -> list[dict[str, object]]:
    return [
        {"load": load, "variant": v.replace("_", "-"), "cpu_ms_per_req": c} for v, c in cpu.items()
    ]


def test_budget_items_are_differences_of_the_ladder() -> None:
    rows = _rows(
        "saturation", floor=0.5, edge=0.7, app_bare=1.2, app_kv=1.6, default=1.9,
        default_1msg=1.7, vllm_router_rr=0.6,
    )  # fmt: skip
    items = {i["item"]: i["ms"] for i in budget(rows)["saturation"]}
    assert items["bare grpc.aio floor, same messages"] == 0.5
    assert items["protocol edge (processor, service, access-log records)"] == 0.2
    assert items["director (decision, accounting, leases, metrics)"] == 0.5
    assert items["KV-event indexing"] == 0.4
    assert items["engine metrics polling"] == 0.3
    assert items["total: default"] == 1.9
    assert items["total: default, one message each way"] == 1.7
    assert items["vllm-router round_robin"] == 0.6
    assert "total: former default (before this work)" not in items  # not measured: not shown


def test_without_the_kv_rung_kv_and_polling_are_one_item() -> None:
    rows = _rows("saturation", floor=0.5, edge=0.7, app_bare=1.2, default=1.9)
    items = {i["item"]: i["ms"] for i in budget(rows)["saturation"]}
    assert items["KV-event indexing + engine metrics polling"] == 0.7
    assert "KV-event indexing" not in items


def test_a_missing_rung_leaves_its_item_out() -> None:
    items = {
        i["item"] for i in budget(_rows("1-connection", floor=0.9, default=3.0))["1-connection"]
    }
    assert items == {"bare grpc.aio floor, same messages", "total: default"}


def test_profile_folds_by_work_and_skips_waiting_threads() -> None:
    raw = "\n".join(
        [
            "thread (1): MainThread;Process (extproc/server/service.py:70);"
            "Director.route (extproc/director/director.py:230);x (prometheus_client/metrics.py:1) 6",
            "thread (1): MainThread;Process (extproc/server/service.py:70);"
            "on_message (extproc/server/processor.py:260) 2",
            "thread (1): MainThread;_run (extproc/kvevents/subscriber.py:300) 2",
            "thread (2): grpc;epoll_wait (libc.so.6) 50",
        ]
    )
    folded = fold_profile(raw)
    assert folded["samples"] == 10  # the waiting thread's 50 samples are not CPU
    assert folded["by_work"] == {
        "decision (Director.route)": 0.6,
        "edge: processor (parse, encode)": 0.2,
        "KV events (indexing)": 0.2,
    }
    assert folded["by_code"]["prometheus_client"] == 0.6
