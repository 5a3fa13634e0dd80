"""`ecomla build zoo-table`: the README's zoo table from saved eval results and build.json, numbers as saved."""

from __future__ import annotations

import json

from ecomla.build import zoo_table


def result(name: str, accs: list[tuple[float, float]], **extra) -> dict:
    tasks = {f"tinyworld_t{i}": {"metric": "acc_norm", "value": n, "average": True, "version": 2.0,
                                 "all_metrics": {"acc": a, "acc_norm": n}} for i, (a, n) in enumerate(accs)}  # fmt: skip
    tasks["tinyworld_ppl"] = {"metric": "word_perplexity", "value": 3.25, "average": False, "version": 2.0,
                              "all_metrics": {"word_perplexity": 3.25}}  # fmt: skip
    avg = sum(n for _, n in accs) / len(accs)
    return {"name": name, "params": 1_250_000, "tasks": tasks, "average": avg, "lm_eval_version": "0.4.13", **extra}


def test_table_rows_show_acc_acc_norm_tokens_and_the_average(tmp_path):
    run = tmp_path / "run"
    (run / "results").mkdir(parents=True)
    for r in (result("base", [(0.9, 0.8), (0.5, 0.6)]), result("teacher-3x", [(0.95, 0.9), (0.6, 0.7)]),
              result("mla", [(0.4, 0.3), (0.3, 0.2)], stage="converted")):  # fmt: skip
        (run / "results" / f"{r['name']}.json").write_text(json.dumps(r))
    build = {"models": {"base": {"tokens": 7_864_320}, "teacher-3x": {"tokens": 9_437_184, "own_tokens": 1_572_864,
                                                                        "grown_from": "base"}}}  # fmt: skip
    rows = zoo_table.table(zoo_table.summarize(zoo_table.load_results(run)), build).splitlines()
    assert rows[0] == ("| model | params | tokens | t0 acc / acc_norm | t1 acc / acc_norm | average (acc_norm) "
                       "| ppl (word_perplexity) |")  # fmt: skip
    by_name = {r.split(" | ")[0].strip("| "): r for r in rows[2:]}
    assert by_name["base"] == "| base | 1.25M | 7.9M | 90.0 / 80.0 | 50.0 / 60.0 | **70.0** | 3.25 |"
    assert "| 9.4M (7.9M as the base) | 95.0 / 90.0 |" in by_name["teacher-3x"]
    assert "| 0 after conversion |" in by_name["mla"] and "**25.0**" in by_name["mla"]
