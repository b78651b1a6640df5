"""A model's quality bar (``params.yaml`` ``models.<name>.bar``): checked on the test metrics by
evaluate, and on an int8 variant's by quantize and publish, which also hold the variant against fp32."""

from __future__ import annotations

import operator

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def check_bar(metrics: dict, bar: list[dict]) -> dict:
    """Each condition ``{metric, op, value}`` of the model's bar, checked against ``metrics``."""
    checks = []
    for cond in bar:
        measured = metrics.get(cond["metric"])
        ok = measured is not None and OPS[cond["op"]](measured, cond["value"])
        checks.append({**cond, "measured": measured, "passed": bool(ok)})
    return {"passed": all(c["passed"] for c in checks), "conditions": checks}


def gate(fp32: dict, int8: dict, bar: list[dict], tolerance: float) -> dict:
    """Each metric of the quality bar, int8 against fp32: worse by at most ``tolerance`` (the bar's
    ``op`` gives the direction: ``>=`` higher is better). A model without a bar has no gate to pass."""
    conditions = []
    for cond in bar:
        metric, higher = cond["metric"], cond["op"] in (">=", ">")
        a, b = fp32.get(metric), int8.get(metric)
        worse = None if a is None or b is None else round((a - b) if higher else (b - a), 6)
        conditions.append({"metric": metric, "fp32": a, "int8": b, "worse_by": worse,
                           "passed": worse is not None and worse <= tolerance})
    return {"tolerance": tolerance, "passed": bool(conditions) and all(c["passed"] for c in conditions),
            "conditions": conditions, **({} if conditions else {"note": "no quality bar to compare on"})}
